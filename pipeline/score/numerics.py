"""The scoring numerics: the engine settings that change the stored logprobs (`scoring_numerics`, the cache's
`numerics`), and the check that an engine handed in scores as the config says (`check_engine_numerics`)."""

from __future__ import annotations

import json

from pipeline.config import ConfigError
from pipeline.score.config import DTYPES, ScoreConfig

# engine_extra options that only change scheduling, memory or placement, never the logprobs of a sequence; every
# other engine_extra option is part of the cache's identity (`scoring_numerics`), so an unknown one cannot mix.
NEUTRAL_ENGINE_OPTIONS = frozenset({
    "block_size", "cpu_offload_gb", "disable_log_stats", "distributed_executor_backend", "enable_prefix_caching",
    "max_num_seqs", "max_seq_len_to_capture", "pipeline_parallel_size", "seed", "swap_space",
})


def scoring_numerics(cfg: ScoreConfig) -> dict[str, str]:
    """The engine settings that change the stored logprobs (besides teacher, k and logprob mode, which are
    descriptor fields of their own): the cache's `numerics`. Settings that change only the order of float sums
    (tensor_parallel_size, batch sizes, eager vs compiled) are not in it: vLLM is not batch-invariant anyway, so the
    same engine gives other last bits for another batch composition; they stay far below the codec's 1/64 nat."""
    extra = dict(cfg.engine_extra)
    out = {"dtype": DTYPES.get(cfg.dtype, cfg.dtype), "quantization": str(extra.pop("quantization", None) or "none"),
           "kv_cache_dtype": str(extra.pop("kv_cache_dtype", None) or "auto")}
    for key in sorted(set(extra) - NEUTRAL_ENGINE_OPTIONS):
        out[f"engine_extra.{key}"] = json.dumps(extra[key], sort_keys=True)
    return out


def check_engine_numerics(llm, numerics: dict[str, str]) -> None:
    """An engine handed in (the on-policy driver's) must score as this config says, or the cache would mix."""
    model_config = getattr(llm, "model_config", None) or llm.llm_engine.model_config
    dtype = str(model_config.dtype).removeprefix("torch.")
    quant = str(getattr(model_config, "quantization", None) or "none")
    found = {"dtype": dtype, "quantization": quant}
    wrong = [f"{k}: engine has {found[k]!r}, the score config {numerics[k]!r}" for k in found if found[k] != numerics[k]]
    if wrong:
        raise ConfigError("the engine passed to score() does not score as configured: " + "; ".join(wrong))
