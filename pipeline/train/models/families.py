"""Which Hugging Face model families the student trainer maps onto Megatron-Core's GPTModel, read from config.json.

Supported (`model_type`): `llama` (Llama-2 style, Llama 3.x with `rope_type: llama3`, SmolLM2), `mistral`,
`qwen2` (Qwen2, Qwen2.5) and `qwen3` (dense). Values are read through transformers' own config class of the
family (`AutoConfig`), so a key missing from config.json gets exactly the default the reference forward (and vLLM)
uses: e.g. Qwen3's `head_dim` defaults to 128, not hidden/heads. Anything the mapping cannot express exactly is
refused here, before any work, with a message naming the key, its value and what is supported; nothing is
approximated. What Megatron-Core 0.16.1 hard-codes and how each value is mapped: docs/architecture.md, "Student
model families".

RoPE: `default` (plain) and `llama3`. Megatron's `RotaryEmbedding(rope_scaling=True)` hard-codes
low_freq_factor=1, high_freq_factor=4 and original_max_position_embeddings=8192, so build_model never uses it: it
builds plain RoPE and replaces `rotary_pos_emb.inv_freq` by `llama3_inv_freq` of the config's own four values.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Keys that give a config experts; their model_types (mixtral, qwen2_moe, qwen3_moe, deepseek_v3, ...) are not
# supported either, but the key names the feature better than the model type does.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")


class UnsupportedModelError(ConfigError):
    """config.json describes something the GPTModel mapping cannot express exactly (a ConfigError: the CLIs print
    it as a message, not a traceback)."""


@dataclass(frozen=True)
class Llama3Rope:
    """`rope_type: llama3` parameters, each read from the config (Megatron's defaults are never assumed)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class HFArch:
    """The config.json fields the mapping needs, validated once."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE
    rope_scaling: Llama3Rope | None = None
    sliding_window: int | None = None  # Mistral: exact only while seq_length <= sliding_window (check_trainable)


def _refuse(key: str, value, supported: str, where: Path) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where}: {key} = {json.dumps(value)} is not supported; {supported}")


def read_hf_arch(hf_dir: str | Path) -> HFArch:
    """Parse config.json of a supported family; refuse (UnsupportedModelError) what the mapping cannot express."""
    path = Path(hf_dir) / "config.json"
    raw = json.loads(path.read_text())
    for key in _MOE_KEYS:
        if raw.get(key) not in (None, 0):
            raise _refuse(key, raw[key], "mixture-of-experts students cannot be trained here (dense models only: "
                          f"model_type {', '.join(SUPPORTED_MODEL_TYPES)})", path)
    for key in _SOFTCAP_KEYS:
        if raw.get(key) is not None:
            raise _refuse(key, raw[key], "logit softcapping has no Megatron-Core local-spec equivalent (supported: "
                          "null / absent)", path)
    nope = raw.get("no_rope_layers")
    if nope is not None and (not isinstance(nope, list) or not all(nope)):
        raise _refuse("no_rope_layers", raw["no_rope_layers"], "layers without RoPE (NoPE) are not mapped: every "
                      "layer must use RoPE (all entries 1, or no such key)", path)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _refuse("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}", path)

    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(hf_dir))  # the family's own defaults for absent keys
    except (ValueError, KeyError, TypeError) as e:  # transformers validates rope parameters, among others
        raise UnsupportedModelError(f"{path}: transformers refuses this config: {e}") from e
    if cfg.hidden_act != "silu":
        raise _refuse("hidden_act", cfg.hidden_act, "supported: silu (SwiGLU MLP)", path)
    if model_type != "qwen2":  # qwen2's q/k/v biases are fixed by the architecture (o_proj and MLP have none)
        for key in ("attention_bias", "mlp_bias"):
            if getattr(cfg, key, None) or raw.get(key):
                raise _refuse(key, raw.get(key, getattr(cfg, key, None)), f"{model_type} is mapped without linear "
                              "biases (Megatron's add_bias_linear would add o_proj and MLP biases together)", path)
    if model_type in ("qwen2", "qwen3"):
        if raw.get("use_sliding_window"):
            raise _refuse("use_sliding_window", raw["use_sliding_window"], "sliding-window layers are not mapped "
                          "(supported: false)", path)
        kinds = sorted(set(getattr(cfg, "layer_types", None) or ["full_attention"]) - {"full_attention"})
        if kinds:
            raise _refuse("layer_types", kinds, "only full_attention layers are mapped", path)
    rope, rope_key = _rope_parameters(cfg, raw, path)
    heads = cfg.num_attention_heads
    return HFArch(
        model_type=model_type,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_heads=heads,
        num_kv_heads=cfg.num_key_value_heads or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        ffn_hidden_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope_theta=float(rope["rope_theta"]),
        max_position_embeddings=cfg.max_position_embeddings,
        tied_embeddings=bool(cfg.tie_word_embeddings),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        rope_scaling=_llama3(rope, rope_key, path),
        sliding_window=getattr(cfg, "sliding_window", None) if model_type == "mistral" else None,
    )


def _rope_parameters(cfg, raw: dict, path: Path) -> tuple[dict, str]:
    """transformers' standardised rope parameters and the config key they were written under (for messages)."""
    key = "rope_parameters" if "rope_parameters" in raw else "rope_scaling"
    rope = dict(cfg.rope_parameters or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        raise _refuse(key, raw.get(key), "per-layer-type RoPE parameters are not mapped", path)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _refuse(f"{key}.rope_type", rope_type, f"supported: {', '.join(ROPE_TYPES)} (yarn, dynamic, linear, "
                      "longrope, ... are not mapped exactly)", path)
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise _refuse("partial_rotary_factor", partial, "supported: 1.0 (RoPE on the whole head)", path)
    return rope, key


def _llama3(rope: dict, key: str, path: Path) -> Llama3Rope | None:
    if rope.get("rope_type", rope.get("type", "default")) != "llama3":
        return None
    missing = [k for k in _LLAMA3_KEYS if rope.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"{path}: {key} has rope_type llama3 but lacks {', '.join(missing)}; all of "
                                    f"{', '.join(_LLAMA3_KEYS)} are read from the config, never assumed")
    if not rope["high_freq_factor"] > rope["low_freq_factor"]:
        raise _refuse(f"{key}.high_freq_factor", rope["high_freq_factor"], "llama3 RoPE needs high_freq_factor > "
                      f"low_freq_factor ({rope['low_freq_factor']})", path)
    return Llama3Rope(float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                      int(rope["original_max_position_embeddings"]))


def check_trainable(arch: HFArch, seq_length: int, where: str | Path = "student config.json") -> None:
    """Refuse a run the mapping would get wrong at this training length: Mistral's sliding window is not mapped,
    and full causal attention equals it only while every sequence fits in the window (the key at distance d is
    visible iff d < sliding_window, in transformers and vLLM alike)."""
    if arch.sliding_window is not None and seq_length > arch.sliding_window:
        raise UnsupportedModelError(
            f"{where}: sliding_window = {arch.sliding_window} is smaller than the training seq_length = {seq_length}; "
            "sliding-window attention is not mapped (exact only while seq_length <= sliding_window): set "
            f"seq_length <= {arch.sliding_window}"
        )


def llama3_inv_freq(inv_freq: torch.Tensor, rope: Llama3Rope) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling of plain inverse frequencies (Meta's reference formula, in
    transformers' operation order so the result is bit-identical to `ROPE_INIT_FUNCTIONS["llama3"]`).

    Wavelengths shorter than original/high_freq_factor stay; longer than original/low_freq_factor are divided by
    `factor`; in between they are blended by how many periods fit in the original context."""
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


# ---------------------------------------------------------------- which backend trains a student

BACKENDS = ("auto", "megatron", "hf")


def hf_refusal(hf_dir: str | Path) -> str | None:
    """Why the transformers backend cannot train this config (None: it can): no causal-LM class in transformers,
    an encoder-decoder, or an encoder-only family (BERT-like models have an LM head class, but attend both ways
    unless the config says is_decoder)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    try:
        cfg = AutoConfig.from_pretrained(str(hf_dir))
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"transformers cannot read it ({e})"
    model_type = cfg.model_type
    if getattr(cfg, "is_encoder_decoder", False):
        return f"model_type {model_type} is an encoder-decoder; the student must be a decoder-only causal LM"
    if getattr(cfg, "vision_config", None) is not None:  # a vision-language model: hf_model.build's VLM path
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            return None
        return f"model_type {model_type} has no image-text-to-text class in transformers (AutoModelForImageTextToText)"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model_type {model_type} has no causal-LM class in transformers (AutoModelForCausalLM)"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(cfg, "is_decoder", False):
        return (f"model_type {model_type} is an encoder-only family (bidirectional attention unless is_decoder: "
                "true); the student must be a causal LM")
    return None


def resolve_backend(hf_dir: str | Path, requested: str, seq_length: int) -> tuple[str, str]:
    """(backend, why) for a student folder: `megatron` for the families Megatron-Core maps exactly (read_hf_arch,
    check_trainable), `hf` (transformers) for every other causal LM; `auto` picks in that order. Refusals name the
    key that blocks a backend: `backend=megatron` with an unmapped family suggests `backend=hf`; a config neither
    backend trains names its model_type and both backends' reasons. The one rule: the trainer, the bench and the
    docs call this."""
    path = Path(hf_dir) / "config.json"
    if requested not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    megatron_no = None
    if requested in ("auto", "megatron"):
        try:
            arch = read_hf_arch(hf_dir)
            check_trainable(arch, seq_length, path)
            return "megatron", f"Megatron-Core maps model_type {arch.model_type} exactly"
        except UnsupportedModelError as e:
            if requested == "megatron":
                raise UnsupportedModelError(f"{e}. backend=hf trains it through transformers") from e
            megatron_no = str(e).removeprefix(f"{path}: ")
    hf_no = hf_refusal(hf_dir)
    if hf_no is not None:
        model_type = json.loads(path.read_text()).get("model_type")
        why = f"megatron: {megatron_no}; hf: {hf_no}" if megatron_no else f"hf: {hf_no}"
        raise UnsupportedModelError(f"{path}: no backend trains model_type {model_type!r} ({why})")
    if megatron_no:
        return "hf", f"transformers (Megatron-Core does not map it: {megatron_no})"
    return "hf", "transformers (backend=hf)"
