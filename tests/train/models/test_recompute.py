"""Activation recompute (pipeline/train/models/recompute.py): selective and full give the gradients of no recompute.

Run: ``python -m pytest tests/train/models/test_recompute.py``. Exact comparison (torch.equal): recompute reruns the same
deterministic CPU kernels on the same inputs in the same process, and every weight gradient is formed by the same
ops in the same order, so anything but bit-identical is a bug (measured: bit-identical for both backends). Each case
also counts forward calls, so a config that silently did not recompute cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from train_fixtures import ARCHS
from train_fixtures import random_ids as _ids

from pipeline.train.models.megatron import build_model, load_hf_weights


def _grads(hf_dir, attention: str, recompute: str, lora: bool = False, attn: dict | None = None):
    model = build_model(hf_dir, attention=attention, recompute=recompute)
    load_hf_weights(model, hf_dir)
    if lora:
        from pipeline.train.models.lora import LoRASpec, apply_lora

        apply_lora(model, LoRASpec(4, 8.0, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")), seed=0)
        with torch.no_grad():  # B starts at zero (no gradient for A): draw it so both factors get one
            g = torch.Generator().manual_seed(2)
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.train()
    calls = {"core_attention": 0, "layer": 0}
    for layer in model.decoder.layers:
        layer.register_forward_hook(lambda *a: calls.__setitem__("layer", calls["layer"] + 1))
        layer.self_attention.core_attention.register_forward_hook(
            lambda *a: calls.__setitem__("core_attention", calls["core_attention"] + 1))
    ids = _ids()
    logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), **(attn or {"attention_mask": None}))
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, calls, len(model.decoder.layers)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention", ["sdpa", "local"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("packed", [False, True])
def test_recompute_gives_the_same_gradients(hf_dirs, single_process, arch, attention, recompute, packed):
    """Also with packed rows as the trainer passes them (attention_inputs: document spans to sdpa, the block-diagonal
    mask to local), which the checkpoints carry as one more input."""
    from test_attention import PACKED, packed_doc_ids

    from pipeline.train.models.attention import attention_inputs

    attn = attention_inputs(packed_doc_ids(PACKED, _ids().shape[1]), packed, attention)
    ref, ref_calls, layers = _grads(hf_dirs[arch], attention, "none", attn=attn)
    grads, calls, _ = _grads(hf_dirs[arch], attention, recompute, attn=attn)
    assert ref_calls == {"core_attention": layers, "layer": layers}
    # selective: core attention runs again in backward; full: the whole layer (and so its attention) does.
    assert calls == {"core_attention": 2 * layers, "layer": layers if recompute == "selective" else 2 * layers}
    assert sorted(grads) == sorted(ref)
    for name in ref:
        assert torch.equal(grads[name], ref[name]), name


def test_full_recompute_trains_lora_adapters(hf_dirs, single_process):
    """A frozen embedding gives layer 0 an input that needs no grad; the reentrant checkpoint would then drop the
    graph and every adapter would get no gradient. keep_inputs_differentiable prevents that."""
    ref, _, _ = _grads(hf_dirs["llama"], "sdpa", "none", lora=True)
    grads, calls, layers = _grads(hf_dirs["llama"], "sdpa", "full", lora=True)
    assert calls["layer"] == 2 * layers
    assert sorted(grads) == sorted(ref) and all(n.endswith(("lora_A", "lora_B")) for n in ref)
    for name in ref:
        assert ref[name].abs().max() > 0, name
        assert torch.equal(grads[name], ref[name]), name


def test_bad_mode_is_refused():
    from pipeline.train.models.recompute import recompute_options

    with pytest.raises(ValueError, match="recompute='some'.*none, selective, full"):
        recompute_options("some")


def test_trainer_keys_reach_the_model(tiny, tmp_path):
    """Through the CLI: recompute=full gives the trajectory of recompute=none bit for bit (SGD, 3 steps), and
    attention=local the same up to float rounding (module docstring of test_attention.py); bad values are refused
    together before any work."""
    from test_run import _metrics, _overrides, train_main

    from pipeline.config import ConfigError, load_config
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import DEFAULT_CONFIG

    with pytest.raises(ConfigError, match="attention must be sdpa or local.*recompute must be none, selective or full"):
        load_config(TrainConfig, DEFAULT_CONFIG, ["attention=flash", "recompute=some"])
    runs = {}
    for name, kw in (("none", {}), ("full", {"recompute": "full"}), ("local", {"attention": "local"})):
        save = tmp_path / name
        assert train_main(_overrides(tiny, save, optimizer="sgd", lr=0.3, train_steps=3, **kw)) == 0
        runs[name] = [(m["loss"], m["grad_norm"]) for m in _metrics(save)]
    assert runs["full"] == runs["none"]  # exact floats
    for (loss, norm), (ref_loss, ref_norm) in zip(runs["local"], runs["none"], strict=True):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and abs(norm - ref_norm) <= 1e-5 * ref_norm
