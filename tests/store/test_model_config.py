"""`model_config.vocab_size`: the one reading of a model's vocabulary, from a config.json dict or a transformers
config, text-only (at the top) or vision-language (in `text_config`)."""

from __future__ import annotations

from pipeline.store.model_config import vocab_size


def test_from_config_json_dicts():
    assert vocab_size({"vocab_size": 49152}) == 49152
    assert vocab_size({"text_config": {"vocab_size": 151936}, "vision_config": {}}) == 151936
    assert vocab_size({"vocab_size": 100, "text_config": {"vocab_size": 7}}) == 100  # the top level first
    assert vocab_size({}) == 0


def test_from_transformers_configs():
    from transformers import LlamaConfig, LlavaConfig

    assert vocab_size(LlamaConfig(vocab_size=321)) == 321
    vlm = LlavaConfig(text_config={"model_type": "llama", "vocab_size": 555})
    assert vocab_size(vlm) == 555 == vocab_size(vlm.to_dict())  # the object and its config.json agree
