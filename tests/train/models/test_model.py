"""HF Llama/Qwen2 <-> Megatron GPTModel: logits equal HF, export round trip bit-identical, TP=2 equals TP=1.

Run: ``python -m pytest tests/train/models/test_model.py`` (``-m "not distributed"`` skips the torchrun test).
Tiny random models (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 256): Llama with tied embeddings like
SmolLM2, Qwen2 with qkv bias and untied embeddings. Weights are re-drawn at a larger scale than HF's init so
logits are O(1) and a wrong mapping cannot hide under a tiny tolerance; norms get non-unit weights so a swapped
norm shows up too.

Device: build_model puts the Megatron model on CUDA when there is one, so its inputs go to its parameters' device
and its logits come back to the CPU to be compared with transformers' (run on the CPU). The tests of
pipeline/train/parallel/compat.py's CPU layer itself are skipped on CUDA, where apply_cpu_compat() is inert by design.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tolerance import assert_layout_close
from train_fixtures import ARCHS
from train_fixtures import random_ids as _ids

from pipeline.train.models.megatron import (
    build_model,
    export_hf,
    hf_to_megatron_state_dict,
    load_hf_weights,
    megatron_to_hf_state_dict,
    read_hf_arch,
    read_hf_state_dict,
)
from pipeline.train.parallel import compat
from pipeline.train.parallel.groups import destroy_distributed, init_distributed

REPO = Path(__file__).resolve().parents[3]


def _hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _device(model) -> torch.device:
    """The Megatron model's device (build_model moves it to CUDA when there is one)."""
    return next(model.parameters()).device


def _megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits on the CPU, where _hf_logits computes the reference."""
    ids = ids.to(_device(model))
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids), None).cpu()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf(hf_dirs, single_process, arch):
    model = build_model(hf_dirs[arch])
    load_hf_weights(model, hf_dirs[arch])
    ids = _ids()
    ref = _hf_logits(hf_dirs[arch], ids)
    assert ref.abs().max() > 1.0  # the check below is meaningful
    torch.testing.assert_close(_megatron_logits(model, ids), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_round_trip_is_bit_identical(hf_dirs, single_process, tmp_path, arch):
    model = build_model(hf_dirs[arch])
    load_hf_weights(model, hf_dirs[arch])
    export_hf(model, hf_dirs[arch], tmp_path / "out")
    src, out = read_hf_state_dict(hf_dirs[arch]), read_hf_state_dict(tmp_path / "out")
    assert sorted(out) == sorted(src)
    for key in src:
        assert torch.equal(out[key], src[key]), key
    assert (tmp_path / "out" / "tokenizer_config.json").exists()
    assert not (tmp_path / "out.partial").exists()
    ids = _ids(1, 8)
    torch.testing.assert_close(_hf_logits(tmp_path / "out", ids), _hf_logits(hf_dirs[arch], ids), rtol=0, atol=0)


def test_vocab_padding_is_zero_and_stripped(hf_dirs, single_process, tmp_path):
    """Vocab padded to 384 (as a TP size not dividing the vocab would force): real logits unchanged, pad = 0."""
    hf_dir = hf_dirs["qwen2"]
    model = build_model(hf_dir, pad_vocab_to_multiple_of=384)
    load_hf_weights(model, hf_dir)
    assert (model.vocab_size, model.hf_vocab_size) == (384, 256)
    ids = _ids()
    logits = _megatron_logits(model, ids)
    torch.testing.assert_close(logits[..., :256], _hf_logits(hf_dir, ids), rtol=0, atol=1e-5)
    assert torch.all(logits[..., 256:] == 0)
    export_hf(model, hf_dir, tmp_path / "out")
    out = read_hf_state_dict(tmp_path / "out")
    assert all(torch.equal(out[k], v) for k, v in read_hf_state_dict(hf_dir).items())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp_size", [2])
def test_pure_mapping_round_trips_through_tp_shards(hf_dirs, arch, tp_size):
    arch_cfg, hf = read_hf_arch(hf_dirs[arch]), read_hf_state_dict(hf_dirs[arch])
    shards = [hf_to_megatron_state_dict(hf, arch_cfg, r, tp_size, padded_vocab_size=258) for r in range(tp_size)]
    assert shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (128 // tp_size, 64)
    back = megatron_to_hf_state_dict(shards, arch_cfg)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], v) for k, v in hf.items())


def test_qkv_is_grouped_per_query_group(hf_dirs):
    """Megatron's fused QKV order is [q heads of group g | k_g | v_g] per group: check one row block directly."""
    arch, hf = read_hf_arch(hf_dirs["qwen2"]), read_hf_state_dict(hf_dirs["qwen2"])
    qkv = hf_to_megatron_state_dict(hf, arch)["decoder.layers.1.self_attention.linear_qkv.weight"]
    d = arch.head_dim
    group1 = qkv[4 * d : 8 * d]  # group 1 = query heads 2, 3, then k_1, v_1
    assert torch.equal(group1[: 2 * d], hf["model.layers.1.self_attn.q_proj.weight"][2 * d : 4 * d])
    assert torch.equal(group1[2 * d : 3 * d], hf["model.layers.1.self_attn.k_proj.weight"][d : 2 * d])
    assert torch.equal(group1[3 * d :], hf["model.layers.1.self_attn.v_proj.weight"][d : 2 * d])


def test_cpu_compat_train_step_and_checkpoint(hf_dirs, single_process, tmp_path):
    """The Megatron paths the trainer uses, on CPU (through compat.py) or on the model's CUDA device: schedule
    (2 micro-batches), DDP, plain Adam with grad clipping, dist_checkpointing save + load."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    hf_dir = hf_dirs["qwen2"]
    model = build_model(hf_dir)
    load_hf_weights(model, hf_dir)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1e-3, params_dtype=torch.float32)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    ids = _ids().to(_device(model))
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)

    def forward_step(data, module):
        def loss_func(logits):
            loss = logits.logsumexp(-1).sum()
            num_tokens = torch.tensor(logits.shape[0] * logits.shape[1], device=logits.device)
            return loss, num_tokens, {"loss": loss.detach()}

        return module(next(data), positions, None), loss_func

    before = [p.detach().clone() for p in model.parameters()]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([ids, ids]),
        model=[ddp],
        num_microbatches=2,
        seq_length=ids.shape[1],
        micro_batch_size=ids.shape[0],
        forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    assert ok and grad_norm > 1e-3  # so clipping ran
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    fresh = build_model(hf_dir)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path)))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "tests compat.py's CPU stand-in for Megatron's clip_grad_by_total_norm_fp32, installed only where CUDA is "
    "absent; on CUDA Megatron's own function runs (and asserts CUDA grads)"))
def test_cpu_grad_clipping_scales_in_place(single_process):
    from megatron.core.optimizer import clip_grads

    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=5.0)
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]))


@pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "apply_cpu_compat() patches only where CUDA is absent (on CUDA it returns False and patches nothing, by "
    "design: test_cpu_compat_is_inert_with_cuda)"))
def test_cpu_compat_is_idempotent():
    import megatron.core.transformer.utils as mutils

    assert compat.apply_cpu_compat() and compat.apply_cpu_compat()
    patched = mutils.torch
    assert patched is not torch and mutils.get_default_causal_mask(3).device.type == "cpu"
    assert compat.apply_cpu_compat() and mutils.torch is patched  # second call changes nothing


def test_cpu_compat_is_inert_with_cuda(monkeypatch):
    """On a GPU machine it must touch nothing, even if it never ran before in the process (on a CPU machine CUDA
    is faked; on a CUDA one the fake changes nothing)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compat, "_APPLIED", False)
    monkeypatch.setattr(compat.importlib, "import_module", lambda name: pytest.fail(f"patched {name}"))
    assert compat.apply_cpu_compat() is False and compat._APPLIED is False


@pytest.mark.distributed
def test_tp2_matches_tp1(hf_dirs, tmp_path):
    ids = _ids()
    torch.save(ids, tmp_path / "ids.pt")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "tests" / "train" / "_tp_worker.py"),
        str(tmp_path / "ids.pt"),
        str(tmp_path),
        *(str(hf_dirs[a]) for a in ARCHS),
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    init_distributed(tp=1, pp=1, seed=0)
    try:
        for arch in ARCHS:
            tp2 = torch.load(tmp_path / f"{arch}.pt")
            model = build_model(hf_dirs[arch])
            load_hf_weights(model, hf_dirs[arch])
            logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
            (logits * weights).sum().backward()
            assert_layout_close(tp2["logits"], logits.detach(), f"{arch} logits")
            assert_layout_close(tp2["norm_grad"], model.decoder.final_layernorm.weight.grad, f"{arch} norm grad")
            exported, src = read_hf_state_dict(tmp_path / f"{arch}-hf"), read_hf_state_dict(hf_dirs[arch])
            assert sorted(exported) == sorted(src)
            assert all(torch.equal(exported[k], v) for k, v in src.items())
    finally:
        destroy_distributed()
