"""GKD pipeline: vLLM teacher -> content-keyed on-disk teacher cache -> Megatron-Core student.

Stages live in `pipeline.generate`, `pipeline.score` and `pipeline.train`; they share only the store
(`pipeline.store`) and the config layer (`pipeline.config`). No stage imports another stage.
"""

__version__ = "0.1.0"
