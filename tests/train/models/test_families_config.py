"""config.json -> HFArch for each supported family, and one test per refused feature (pipeline/train/models/families.py).

Only config.json is written (read_hf_arch reads nothing else), so these run in a second. The accepted configs are
shaped like the published ones of the recipe students (configs/recipes/), with their key spelling (legacy
`rope_scaling` + `rope_theta`, absent keys left to the family's defaults).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.train.models.families import Llama3Rope, UnsupportedModelError, check_trainable, read_hf_arch

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu")


def _write(tmp_path: Path, **cfg) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


# -- accepted: the published layouts ---------------------------------------------------------------------------


def test_llama_3_2_layout(tmp_path):
    arch = read_hf_arch(_write(
        tmp_path, model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, hidden_act="silu",
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}))
    assert arch.rope_scaling == Llama3Rope(32.0, 1.0, 4.0, 8192)
    assert (arch.rope_theta, arch.head_dim, arch.tied_embeddings, arch.qkv_bias, arch.qk_norm) == (5e5, 64, True, False, False)


def test_qwen3_layout_gets_the_family_head_dim(tmp_path):
    """Qwen3 without a head_dim key: transformers' Qwen3Config default 128, not hidden/heads = 16."""
    arch = read_hf_arch(_write(tmp_path, model_type="qwen3", **BASE, rope_theta=1e6, tie_word_embeddings=True,
                               attention_bias=False, use_sliding_window=False, sliding_window=None,
                               max_window_layers=28, rope_scaling=None))
    assert (arch.head_dim, arch.qk_norm, arch.qkv_bias, arch.rope_scaling, arch.sliding_window) == (128, True, False, None, None)


def test_qwen2_5_layout(tmp_path):
    """Qwen2.5 ships sliding_window values with use_sliding_window false: full attention, accepted."""
    arch = read_hf_arch(_write(tmp_path, model_type="qwen2", **{**BASE, "vocab_size": 320}, rope_theta=1e6,
                               tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
                               max_window_layers=21))
    assert (arch.qkv_bias, arch.qk_norm, arch.vocab_size, arch.sliding_window, arch.head_dim) == (True, False, 320, None, 16)
    check_trainable(arch, 1_000_000)


def test_mistral_layouts(tmp_path):
    v03 = read_hf_arch(_write(tmp_path, model_type="mistral", **BASE, rope_theta=1e6, sliding_window=None))
    assert v03.sliding_window is None
    check_trainable(v03, 1_000_000)
    v01 = read_hf_arch(_write(tmp_path, model_type="mistral", **BASE, rope_theta=1e4, sliding_window=4096))
    check_trainable(v01, 4096)
    with pytest.raises(UnsupportedModelError, match="sliding_window = 4096 .* seq_length = 4097;.* set seq_length <= 4096"):
        check_trainable(v01, 4097)


def test_absent_keys_take_the_family_defaults(tmp_path):
    """rms_norm_eps, rope_theta, tie_word_embeddings absent: transformers' LlamaConfig defaults (1e-6, 1e4, False)."""
    cfg = {k: v for k, v in BASE.items() if k != "rms_norm_eps"}
    arch = read_hf_arch(_write(tmp_path, model_type="llama", **cfg))
    assert (arch.rms_norm_eps, arch.rope_theta, arch.tied_embeddings, arch.num_kv_heads) == (1e-6, 1e4, False, 2)


# -- refused, each naming the key, its value and what is supported -----------------------------------------------


def _refused(tmp_path: Path, *fragments: str, **cfg) -> str:
    with pytest.raises(UnsupportedModelError) as e:
        read_hf_arch(_write(tmp_path, **cfg))
    msg = str(e.value)
    assert str(tmp_path / "config.json") in msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    return msg


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "linear"])
def test_unknown_rope_type(tmp_path, rope_type):
    _refused(tmp_path, f'rope_scaling.rope_type = "{rope_type}"', "supported: default, llama3",
             model_type="llama", **BASE, rope_scaling={"rope_type": rope_type, "factor": 4.0,
                                                        "original_max_position_embeddings": 1024})


def test_llama3_parameters_are_never_assumed(tmp_path):
    _refused(tmp_path, "low_freq_factor", "high_freq_factor", model_type="llama", **BASE,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024})


@pytest.mark.parametrize("family,key", [("llama", "attention_bias"), ("llama", "mlp_bias"), ("qwen3", "attention_bias"),
                                        ("mistral", "attention_bias")])
def test_linear_biases(tmp_path, family, key):
    _refused(tmp_path, f"{key} = true", "without linear biases", model_type=family, **BASE, **{key: True})


@pytest.mark.parametrize("family,key", [("mixtral", "num_local_experts"), ("qwen3_moe", "num_experts"),
                                        ("llama", "num_local_experts")])
def test_mixture_of_experts(tmp_path, family, key):
    _refused(tmp_path, f"{key} = 8", "mixture-of-experts", "dense models only", model_type=family, **BASE, **{key: 8})


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_softcapping(tmp_path, key):
    _refused(tmp_path, f"{key} = 30.0", "softcapping", "supported: null", model_type="llama", **BASE, **{key: 30.0})


def test_nope_layers(tmp_path):
    _refused(tmp_path, "no_rope_layers = [1, 1, 0, 1]", "every layer must use RoPE", model_type="llama", **BASE,
             no_rope_layers=[1, 1, 0, 1])


def test_hidden_act(tmp_path):
    _refused(tmp_path, 'hidden_act = "gelu_pytorch_tanh"', "supported: silu",
             model_type="llama", **{**BASE, "hidden_act": "gelu_pytorch_tanh"})


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_window_layers(tmp_path, family):
    _refused(tmp_path, "use_sliding_window = true", "supported: false", model_type=family, **BASE,
             use_sliding_window=True, sliding_window=64, max_window_layers=0)


def test_qwen_sliding_layer_types(tmp_path):
    _refused(tmp_path, 'layer_types = ["sliding_attention"]', "only full_attention", model_type="qwen3", **BASE,
             layer_types=["full_attention", "sliding_attention"], sliding_window=64)


def test_partial_rotary(tmp_path):
    _refused(tmp_path, "partial_rotary_factor = 0.5", "supported: 1.0", model_type="llama", **BASE,
             partial_rotary_factor=0.5)


def test_unknown_model_type(tmp_path):
    _refused(tmp_path, 'model_type = "gemma2"', "supported: llama, mistral, qwen2, qwen3", model_type="gemma2", **BASE)
