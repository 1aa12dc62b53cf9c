"""GKD pipeline: vLLM teacher -> content-keyed on-disk teacher cache -> student
(Megatron-Core, or transformers for the families Megatron-Core does not map: pipeline/train/models/families.py).

Stages live in `pipeline.generate`, `pipeline.score` and `pipeline.train`; they share only the store
(`pipeline.store`) and the config layer (`pipeline.config`). No stage imports another stage.
"""

__version__ = "0.1.0"

# Before any stage imports vLLM, Megatron or transformers: their INFO logs and known-harmless warnings stay hidden
# unless GKD_LOG_LEVEL=debug (`gkd --verbose ...`); pipeline/logs.py says what and why.
from pipeline import logs as _logs  # noqa: E402

_logs.configure()

# A child of a `gkd` command (a spawn worker, a stage subprocess) dies with it, also after kill -9: pipeline/lifetime.py
from pipeline import lifetime as _lifetime  # noqa: E402

_lifetime.watch_parent()
