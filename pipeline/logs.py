"""Quiet by default: our progress bars and one-line summaries; third-party INFO logs and known-harmless warnings
only with `--verbose` (or `GKD_LOG_LEVEL=debug`).

What is hidden and why (docs/dependencies.md, "Output"):
- vLLM logs every engine setting at INFO and, on CPU, a dozen environment notices at WARNING (no tcmalloc, no
  Triton CPU backend, thread binding); `VLLM_LOGGING_LEVEL` is read when vLLM is first imported, so it is set here,
  before any stage imports vLLM, and inherited by every subprocess (vLLM's engine core, torchrun ranks, the demo's
  stage commands).
- Megatron-Core warns at import that Transformer Engine and Apex are missing (we use its local spec on purpose),
  and Megatron/torch checkpointing emit deprecation warnings we cannot act on: filtered by the module that warns.
- torch's C++ warnings (NUMA binding) go through c10's logger: `TORCH_CPP_LOG_LEVEL`.
- transformers' INFO and its weight-loading bar: `TRANSFORMERS_VERBOSITY`, `HF_HUB_DISABLE_PROGRESS_BARS`.

A variable the user set explicitly always wins (setdefault). Errors, and warnings raised by our own code, always show.
"""

from __future__ import annotations

import logging
import os
import warnings

ENV = "GKD_LOG_LEVEL"

# env var -> value while quiet. Only defaults: an explicit setting of the user's is kept.
_QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
# Third-party modules whose import-time and deprecation warnings are known to be harmless here.
_QUIET_MODULES = r"(megatron|torch|vllm|transformers|peft|triton|numba|torchvision)(\.|$)"


def verbose() -> bool:
    """True when the user asked for everything (`--verbose` on the command line sets GKD_LOG_LEVEL=debug)."""
    return os.environ.get(ENV, "").lower() in ("debug", "verbose", "info")


def configure(*, verbose_now: bool | None = None) -> None:
    """Apply the quiet defaults (or, verbose, leave every third-party default alone). Idempotent; call it before
    vLLM, Megatron or transformers are imported: the package's `__init__` does, and `gkd --verbose` again."""
    if verbose_now:
        os.environ[ENV] = "debug"
    if verbose():
        for name, value in _QUIET_ENV.items():
            if os.environ.get(name) == value and os.environ.get(f"_GKD_SET_{name}"):
                del os.environ[name]  # ours, not the user's: back to the library's default
        warnings.filterwarnings("default", module=_QUIET_MODULES)
        logging.getLogger("vllm").setLevel(logging.NOTSET)
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.NOTSET)
        return
    for name, value in _QUIET_ENV.items():
        if name not in os.environ:
            os.environ[name] = value
            os.environ[f"_GKD_SET_{name}"] = "1"
    # A vLLM module imported before vLLM configures its logger (triton_utils, through torch's own imports) logs
    # through Python's last-resort handler; the level on the "vllm" logger covers that window too.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    # The CUDA build of torch that `make setup` installs on CPU machines (docs/dependencies.md) warns at import, in
    # every process, "No CUDA runtime is found, using CUDA_HOME=...": true and harmless on a CPU machine.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=_QUIET_MODULES)


def strip_verbose(argv: list[str]) -> tuple[list[str], bool]:
    """argv without `--verbose`/`-v` (accepted anywhere on a `gkd` command line), and whether it was there."""
    rest = [a for a in argv if a != "--verbose"]
    return rest, len(rest) != len(argv)
