"""The supported student families (pipeline/train/models/families.py) through the Megatron mapping, export and vLLM.

Run: ``python -m pytest tests/train/models/test_families.py`` (``-m "not distributed"`` skips the torchrun test).
Every family is a tiny random model of tests/tiny_models.py `build_family` (transformers' own config classes, the
test tokenizer, head_dim 32 so vLLM's CPU backend runs it). Sequences are 80 tokens: past llama3's
original_max_position_embeddings (16) and every band of its scaled frequencies, within Mistral's window (96).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tiny_cache import score_into_cache
from tiny_models import FAMILIES, LLAMA3_ROPE, MISTRAL_WINDOW, build_family

from pipeline.train.models.families import Llama3Rope, check_trainable, llama3_inv_freq
from pipeline.train.models.megatron import build_model, export_hf, load_hf_weights, read_hf_arch, read_hf_state_dict

REPO = Path(__file__).resolve().parents[3]
SEQ = 80


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: build_family(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def family_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache scored (transformers forward) by a Qwen3 teacher with the test tokenizer, so every family's student
    (same tokenizer) trains on it: 16 samples of 20-40 tokens."""
    root = tmp_path_factory.mktemp("family-cache")
    teacher = build_family("qwen3", root / "teacher", seed=5)
    rng = np.random.default_rng(0)
    samples = [(rng.integers(3, 384, int(n)).astype(np.int32), int(p), "dataset" if i % 2 else "student")
               for i, (n, p) in enumerate(zip(rng.integers(20, 40, 16), rng.integers(2, 10, 16), strict=True))]
    score_into_cache(teacher, root / "cache", samples)
    return root / "cache"


def _ids(batch: int = 2, seq: int = SEQ, vocab: int = 384) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(11))


def _hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)[..., : model.hf_vocab_size]


def test_llama3_inv_freq_is_transformers_bit_for_bit():
    """Our llama3 scaling of the plain frequencies equals transformers' rope init exactly, the tiny config puts
    frequencies in all three bands, and Megatron's hard-coded parameters (low 1, high 4, original 8192) would give
    other frequencies (so the logits test below would catch a mapping that used them)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from tiny_models import family_config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = family_config("llama3", 384)
    ref, scale = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert scale == 1.0
    plain = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=10000.0, use_cpu_initialization=True).inv_freq
    ours = llama3_inv_freq(plain, Llama3Rope(**{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}))
    assert torch.equal(ours, ref)
    wavelen = 2 * torch.pi / plain
    orig = LLAMA3_ROPE["original_max_position_embeddings"]
    kept, divided = wavelen < orig / LLAMA3_ROPE["high_freq_factor"], wavelen > orig / LLAMA3_ROPE["low_freq_factor"]
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # high, low and blended bands all present
    megatron_defaults = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=10000.0, rope_scaling=True,
                                        rope_scaling_factor=8.0, use_cpu_initialization=True).inv_freq
    assert not torch.allclose(megatron_defaults, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(families, single_process, family):
    """Megatron forward == transformers forward of the same weights, at all 80 positions. fp32 on both sides, the same
    operations up to summation order: measured max abs diff 1.0-2.0e-6 of the logits' scale (max |logit| ~5) over
    the six families; the bound is 1e-5 of the scale. A wrong mapping is off by > 1e-2 (llama3 test below)."""
    model = build_model(families[family])
    load_hf_weights(model, families[family])
    ids = _ids()
    ref = _hf_logits(families[family], ids)
    assert ref.abs().max() > 1.0  # the check below is meaningful
    torch.testing.assert_close(_megatron_logits(model, ids), ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_llama3_logits_differ_from_plain_rope(families, single_process):
    """Positions past original_max_position_embeddings do feel the scaling (so the match above is not vacuous)."""
    model = build_model(families["llama3"])
    load_hf_weights(model, families["llama3"])
    ids = _ids(1)
    scaled = _megatron_logits(model, ids)
    model.rotary_pos_emb.forward.cache_clear()
    model.rotary_pos_emb.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    plain = _megatron_logits(model, ids)
    assert (scaled - plain)[0, LLAMA3_ROPE["original_max_position_embeddings"]:].abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_is_bit_identical(families, single_process, tmp_path, family):
    model = build_model(families[family])
    load_hf_weights(model, families[family])
    export_hf(model, families[family], tmp_path / "out")
    src, out = read_hf_state_dict(families[family]), read_hf_state_dict(tmp_path / "out")
    assert sorted(out) == sorted(src)
    for key in src:
        assert torch.equal(out[key], src[key]), key
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    original = json.loads((families[family] / "config.json").read_text())
    assert {k: v for k, v in exported.items() if k != "dtype"} == {k: v for k, v in original.items() if k != "dtype"}


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_loads_the_export(families, single_process, tmp_path, family):
    """vLLM (CPU, fp32) loads the Megatron export and its prompt logprobs equal a transformers forward of it.
    Bound 1e-4 nat: measured 2.8-4.8e-6 over the six families (docs/architecture.md, "Student model families")."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from pipeline.engine import EngineArgs, open_engine

    model = build_model(families[family])
    load_hf_weights(model, families[family])
    export_hf(model, families[family], tmp_path / "out")
    ids = _ids(1)
    ref = torch.log_softmax(_hf_logits(tmp_path / "out", ids)[0].double(), -1)
    args = EngineArgs(model=str(tmp_path / "out"), dtype="float32", max_model_len=SEQ + 1, kv_cache_gib=0.25,
                      enforce_eager=True)
    with open_engine(args, max_logprobs=5) as llm:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids[0].tolist())],
                           SamplingParams(max_tokens=1, prompt_logprobs=5, detokenize=False), use_tqdm=False)[0]
    worst = max(abs(lp.logprob - ref[j - 1, tok].item())
                for j, pos in enumerate(out.prompt_logprobs) if pos for tok, lp in pos.items())
    assert len(out.prompt_logprobs) == SEQ and worst < 1e-4, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_train_checkpoint_export(families, family_cache, tmp_path, family):
    """`train` (2 steps, checkpoint) then `gkd export` of that checkpoint: the HF folder holds the trained weights
    (every tensor of the source, q/k norms included, moved) and transformers' forward of it equals the Megatron
    forward of the checkpoint loaded back (same bound as the logits test)."""
    from pipeline.train import checkpoint
    from pipeline.train.config import TrainConfig
    from pipeline.train.export import export
    from pipeline.train.loop import train
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    cfg = TrainConfig(student=str(families[family]), cache=[str(family_cache)], micro_batch_size=2, global_batch_size=4,
                      seq_length=64, train_steps=2, warmup_steps=0, lr=1e-3, min_lr=1e-3, save_dir=str(tmp_path / "run"),
                      save_interval=2, progress=False, prefetch=0)
    assert train(cfg)["step"] == 2
    export(tmp_path / "run", tmp_path / "hf")
    src, out = read_hf_state_dict(families[family]), read_hf_state_dict(tmp_path / "hf")
    assert sorted(out) == sorted(src)
    assert all(not torch.equal(out[k], v) for k, v in src.items()), [k for k, v in src.items() if torch.equal(out[k], v)]
    init_distributed(tp=1, pp=1, seed=0)
    try:
        model = build_model(families[family])
        checkpoint.load(checkpoint.latest(tmp_path / "run"), model)
        ids = _ids(1, 64)
        ref = _hf_logits(tmp_path / "hf", ids)
        torch.testing.assert_close(_megatron_logits(model, ids), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    finally:
        destroy_distributed()


def test_mistral_window_is_checked_against_seq_length(families):
    arch = read_hf_arch(families["mistral"])
    assert arch.sliding_window == MISTRAL_WINDOW
    check_trainable(arch, MISTRAL_WINDOW)  # every key at distance < window: full causal attention is exact
    with pytest.raises(ValueError, match=rf"sliding_window = {MISTRAL_WINDOW} .* seq_length = {MISTRAL_WINDOW + 1}"):
        check_trainable(arch, MISTRAL_WINDOW + 1)


def test_trainer_refuses_a_short_window_before_any_work(families, tmp_path):
    """`train` checks the student against its seq_length first: the cache below does not even exist. backend=auto
    trains such a student on the transformers backend, which implements the sliding window itself."""
    from pipeline.train.config import TrainConfig
    from pipeline.train.loop import train
    from pipeline.train.models.families import resolve_backend

    cfg = TrainConfig(student=str(families["mistral"]), cache=[str(tmp_path / "no-cache")], seq_length=128,
                      save_dir=str(tmp_path / "run"), progress=False, backend="megatron")
    with pytest.raises(ValueError, match="sliding_window = 96 is smaller than the training seq_length = 128.*"
                                         "backend=hf trains it"):
        train(cfg)
    assert not (tmp_path / "run").exists()
    backend, why = resolve_backend(families["mistral"], "auto", 128)
    assert backend == "hf" and "sliding_window = 96" in why
    assert resolve_backend(families["mistral"], "auto", 96)[0] == "megatron"


@pytest.mark.distributed
@pytest.mark.slow  # CI: TP=2 on the llama layout (test_model.py) and qwen3 at TP=1 (above)
def test_qwen3_tp2_step_matches_tp1(families, family_cache, tmp_path):
    """One trainer step of a Qwen3 student at TP=2 vs TP=1: q/k norms act on each rank's heads, so their gradients
    are partial per rank until finalize_model_grads sums them (TransformerConfig.qk_layernorm). Compared by the
    cross-layout rule of tests/tolerance.py."""
    from tolerance import assert_layout_close

    worker = str(Path(__file__).resolve().parents[1] / "_train_tp_worker.py")
    args = [str(families["qwen3"]), str(family_cache), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, worker, *args, "1"], check=True, env=env, cwd=REPO, timeout=1800)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    worker, *args, "2"], check=True, env=env, cwd=REPO, timeout=1800)
    one, two = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    assert one["counts"] == two["counts"]
    assert_layout_close(two["sums"], one["sums"], "loss sums")
    assert_layout_close(torch.tensor(two["grad_norm"]), torch.tensor(one["grad_norm"]), "grad norm")
    norms = [k for k in one["grads"] if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 4 and all(one["grads"][k].abs().max() > 0 for k in norms)
    assert_layout_close(two["grads"], one["grads"], "grads")
