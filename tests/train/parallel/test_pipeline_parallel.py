"""Pipeline parallelism on the Megatron backend (issue 48, first cut): PP=2 == PP=1.

- One trainer step at PP=2 (torchrun, gloo; 2 processes, PP=2 x TP=2, x DP=2 and x CP=2 on 4: stage 0 holds layer 0 and the embedding, stage 1 layer 1,
  the final norm, the output layer and the loss) vs PP=1, 4 micro-batches (1F1B's warm-up, steady state and
  cool-down): the same counts, the loss sums the loop reports (summed on the last stage, broadcast), the grad norm
  and every gradient (HF layout, stages merged by global layer index) under tests/tolerance.py's rule, for packed
  rows + the fused loss, padded rows of varying width + the unfused loss + selective recompute, a student with tied
  embeddings (the last stage's copy of the embedding gets the same summed gradient), bf16 and loss=opd; and the scoring
  model as the student has KD ≈ 0 per active position at PP=2 (the last stage pairs positions and teacher rows).
- Routed teachers under PP=2: 2 CLI steps match PP=1, the per-teacher metrics included.
- Through the CLI: 3 SGD steps at PP=2, stopped after step 2 and resumed from its checkpoint, against 3 steps at
  PP=1: per-step losses and grad norms of metrics.jsonl (written by rank 0, a first-stage rank), the same fields, and
  what training changed in the weights `gkd export` writes from the PP=2 checkpoint, with the tied student; and each
  run's step-2 checkpoint resumed at the other pipeline size (P=2 -> P=1 and back) continues the same trajectory.
  The stopped and resumed PP=2 run, and one killed (SIGKILL, its process group) after step 3 before that step's
  checkpoint and rerun, equal an uninterrupted PP=2 run bit for bit (metrics and the step-3 checkpoint).
- Interleaved 1F1B (virtual_pipeline_model_parallel_size=2 x PP=2, a 4-layer tied student, one layer per model
  chunk): 3 CLI steps, stopped after step 2 and resumed from the chunked checkpoint, match PP=1 (losses, grad norms,
  and the trained change of the exported weights).

Run: ``python -m pytest tests/train/parallel/test_pipeline_parallel.py`` (the torchrun tests are marked distributed). The
refusals of keys PP does not run with yet are in tests/test_bad_inputs.py (`test_pipeline_parallel_settings`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import killing
import pytest
import torch
from tolerance import assert_layout_close

from pipeline.train.metrics import KD_SUM, OPD_KL_SUM, OPD_SUM, SFT_SUM

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tied(tiny, tmp_path_factory) -> Path:
    """A 2-layer student with tied embeddings and the cache's tokenizer."""
    from tiny_models import build_llama, build_tokenizer

    out = tmp_path_factory.mktemp("tied") / "tied"
    tok = build_tokenizer(out)
    return build_llama(out, vocab_size=len(tok), layers=2, hidden=64, heads=2, kv_heads=2, seed=2, tie=True,
                       scale=25.0)


@pytest.fixture(scope="module")
def four(tiny, tmp_path_factory) -> Path:
    """A 4-layer student with tied embeddings and the cache's tokenizer: P=2 x V=2 gives each model chunk one layer
    (stage 0: layers 0 and 2, stage 1: layers 1 and 3; the embedding in chunk 0 of stage 0, its copy in chunk 1 of
    stage 1)."""
    from tiny_models import build_llama, build_tokenizer

    out = tmp_path_factory.mktemp("four") / "four"
    tok = build_tokenizer(out)
    return build_llama(out, vocab_size=len(tok), layers=4, hidden=64, heads=2, kv_heads=2, seed=2, tie=True,
                       scale=25.0)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _worker(tiny: dict, tied: Path, out: Path, pp: int, tp: int = 1, dp: int = 1, cp: int = 1) -> dict:
    args = [str(Path(__file__).resolve().parents[1] / "_pp_worker.py"), str(tiny["student"]), str(tied), str(tiny["model"]),
            str(tiny["cache"]), str(out), str(pp), str(tp), str(cp)]
    world = pp * tp * dp * cp
    launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    subprocess.run([sys.executable, *launcher, *args], check=True, env=_env(), cwd=REPO, timeout=1800)
    return torch.load(out / f"pp{pp}_tp{tp}_cp{cp}.pt")


@pytest.fixture(scope="module")
def pp1(tiny, tied, tmp_path_factory) -> dict:
    """The PP=1 reference: one process."""
    return _worker(tiny, tied, tmp_path_factory.mktemp("pp1"), 1)


@pytest.mark.distributed
# CI: pp2 and pp2 x tp2; the 4-process x dp2 and x cp2 are `slow` (make test-slow), ~1 min each on 2 cores
@pytest.mark.parametrize("tp,dp,cp", [(1, 1, 1), (2, 1, 1), pytest.param(1, 2, 1, marks=pytest.mark.slow),
                                      pytest.param(1, 1, 2, marks=pytest.mark.slow)],
                         ids=["pp2", "pp2 x tp2", "pp2 x dp2", "pp2 x cp2"])
def test_pp2_step_matches_pp1(tiny, tied, pp1, tp, dp, cp, tmp_path):
    one, two = pp1, _worker(tiny, tied, tmp_path, 2, tp, dp, cp)
    assert set(one) == {"packed fused", "padded unfused recompute", "tied", "bf16", "opd", "aligned", "lora"}
    assert float(one["opd"]["sums"][OPD_SUM]) != 0 and float(one["opd"]["sums"][OPD_KL_SUM]) != 0  # sums to compare
    assert next(iter(two.values()))["dp"] == dp
    assert len({w for w in one["padded unfused recompute"]["widths"]}) > 1  # rows of varying width crossed stages
    assert one["packed fused"]["samples"] > 4 * 2  # packed: more samples than rows
    assert set(two) == (set(one) if tp * dp * cp == 1 else {"packed fused", "tied"})  # _pp_worker.TP_VARIANTS
    for name in two:
        a, b = one[name], two[name]
        assert a["layers"] == 2 and b["layers"] == 1, name  # each stage built its own layer
        assert a["reports"] == 4 and b["reports"] == 0, name  # rank 0 is the first stage: no loss there
        assert a["counts"] == b["counts"] and a["counts"][0] > 0 and a["counts"][1] > 0, name
        assert float(a["sums"][KD_SUM]) > 0 and float(a["sums"][SFT_SUM]) > 0, name
        assert_layout_close(b["sums"], a["sums"], f"{name} loss sums")
        assert_layout_close(torch.tensor(b["grad_norm"]), torch.tensor(a["grad_norm"]), f"{name} grad norm")
        assert_layout_close(b["grads"], a["grads"], f"{name} grads")
    for run in (one, two) if "aligned" in two else ():  # the last stage pairs each position with its teacher row
        kd = float(run["aligned"]["sums"][KD_SUM]) / run["aligned"]["counts"][0]
        assert kd < 2e-4, kd  # codec quantisation only (test_run.py: a row one position off is > 100x this)
    # tied: the last stage's copy of the embedding ends the step with the first stage's (summed) gradient
    t = two["tied"]
    assert one["tied"]["tied_copy"] is None and t["tied_copy"] is not None and t["embedding"] is not None
    assert torch.equal(t["tied_copy"], t["embedding"])


def _train_args(tiny: dict, student: Path, save: Path, *extra: str) -> list[str]:
    return [f"student={student}", f"cache=[{tiny['cache']}]", "micro_batch_size=2", "global_batch_size=8",
            "seq_length=64", "train_steps=3", "warmup_steps=0", "optimizer=sgd", "lr=0.5", "min_lr=0.5",
            "sft_alpha=0.5", f"save_dir={save}", "save_interval=1", "progress=false", *extra]


def _from_step_2(run: Path, to: Path) -> Path:
    """A save_dir holding `run`'s checkpoint of step 2 (and its metrics up to it): a resume continues at step 3."""
    import shutil

    to.mkdir()
    shutil.copytree(run / "step_0000002", to / "step_0000002")
    (to / "latest").write_text("step_0000002")
    (to / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(keepends=True)[:2]))
    return to


def _metrics(save: Path) -> list[dict]:
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


def _torchrun_train(*args: str, nproc: int = 2) -> None:
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                    "-m", "pipeline.train.run", *args], check=True, env=_env(), cwd=REPO, timeout=1800)


@pytest.mark.distributed
@pytest.mark.slow  # ~5 min on 2 cores (8 runs); CI: PP=2 x VPP=2 stopped and resumed against PP=1
def test_pp2_training_run_resumes_and_matches_pp1(tiny, tied, tmp_path):
    """Through the CLI, with the tied student (the checkpoint's embedding and the last stage's replica of it): 3 SGD
    steps at PP=2 under torchrun (stopped after step 2, resumed) against 3 at PP=1; and each run's step-2 checkpoint
    resumed at the other pipeline size (dist_checkpointing reshards the layers and the SGD momentum); the resumed PP=2
    run equals an uninterrupted one bit for bit."""
    from safetensors.torch import load_file

    from pipeline.cli import main as cli

    one, two = tmp_path / "pp1", tmp_path / "pp2"
    pp2 = "pipeline_model_parallel_size=2"
    assert cli(["train", *_train_args(tiny, tied, one)]) == 0
    for stop in (("exit_after=2",), ()):
        _torchrun_train(*_train_args(tiny, tied, two, pp2, *stop))
    two_to_one, one_to_two = _from_step_2(two, tmp_path / "pp2-to-pp1"), _from_step_2(one, tmp_path / "pp1-to-pp2")
    assert cli(["train", *_train_args(tiny, tied, two_to_one)]) == 0
    _torchrun_train(*_train_args(tiny, tied, one_to_two, pp2))
    runs = (one, two, two_to_one, one_to_two)
    metrics = {save: [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()] for save in runs}
    for save in runs[1:]:
        assert [m["step"] for m in metrics[save]] == [1, 2, 3], save
        for a, b in zip(metrics[one], metrics[save], strict=True):
            assert set(a) == set(b)
            for key in ("active_tokens", "samples", "real_tokens", "data_position", "padding_fraction"):
                assert a[key] == b[key], key
            assert b["jsd"] > 0 and b["sft"] > 0
            assert_layout_close(torch.tensor([b["loss"], b["jsd"], b["sft"], b["grad_norm"]]),
                                torch.tensor([a["loss"], a["jsd"], a["sft"], a["grad_norm"]]),
                                f"{save.name} step {a['step']}")
    start = load_file(tied / "model.safetensors")
    assert "lm_head.weight" not in start and "model.embed_tokens.weight" in start
    change = {}
    for save in runs:  # gkd export loads the checkpoint at PP=1, whatever its pipeline size
        assert cli(["export", "--checkpoint", str(save), "--out", str(save / "hf")]) == 0
        weights = load_file(save / "hf" / "model.safetensors")
        change[save] = {k: weights[k] - start[k] for k in start}
    for save in runs[1:]:  # a lost momentum buffer would make step 3's update differ by its own size
        assert_layout_close(change[save], change[one], f"{save.name}: trained change")
    # the stopped and resumed PP=2 run is the uninterrupted one, bit for bit (same layout, same order: rule 3)
    whole = tmp_path / "pp2-whole"
    _torchrun_train(*_train_args(tiny, tied, whole, pp2))
    keys = ("step", "loss", "jsd", "sft", "lr", "grad_norm", "active_tokens", "data_position", "samples")
    # kill -9 of the PP=2 run after step 3, before its checkpoint (both ranks stop themselves there: killing.py, no
    # race with a loaded machine), rerun: it redoes step 3 from the step-2 checkpoint, bit for bit the whole run's
    killed = tmp_path / "pp2-killed"
    proc = killing.start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                          "pipeline.train.run", *_train_args(tiny, tied, killed, pp2)], "train-step:3", env=_env(),
                         cwd=REPO)
    try:
        killing.wait_stopped(proc, deadline_s=1800)
    finally:
        killing.kill(proc, group=True)
    assert (killed / "latest").read_text() == "step_0000002" and not (killed / "step_0000003").exists()
    assert [json.loads(x)["step"] for x in (killed / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    _torchrun_train(*_train_args(tiny, tied, killed, pp2))
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for save in (two, killed):
        assert [[m[k] for k in keys] for m in _metrics(save)] == [[m[k] for k in keys] for m in _metrics(whole)]
    weights = {}
    for save in (two, killed, whole):
        dcp_to_torch_save(save / "step_0000003", tmp_path / f"{save.name}.pt")
        weights[save] = torch.load(tmp_path / f"{save.name}.pt")
    assert len(weights[whole]) > 10
    for save in (two, killed):
        assert weights[save].keys() == weights[whole].keys()
        assert all(torch.equal(weights[save][k], weights[whole][k]) for k in weights[whole]
                   if torch.is_tensor(weights[whole][k])), save.name



@pytest.mark.distributed
@pytest.mark.slow  # CI: PP=2 x VPP=2 resumed (below) and LoRA checkpoints (test_lora.py)
def test_pp2_lora_run_resumes_at_pp1_and_exports_the_pp1_adapter(tiny, tmp_path):
    """LoRA under PP=2 through the CLI: 3 SGD steps at PP=2 (torchrun) against 3 at PP=1, and the PP=2 run's step-2
    adapter checkpoint resumed at PP=1 (adapter keys and seeds count layers over the whole model, so the stages'
    adapters neither start apart from PP=1's nor collide in the checkpoint): the same steps, and `gkd export
    --adapter-only` writes the same trained adapter for all three."""
    from safetensors.torch import load_file

    from pipeline.cli import main as cli

    lora = "lora_rank=4"
    one, two = tmp_path / "pp1", tmp_path / "pp2"
    assert cli(["train", *_train_args(tiny, tiny["student"], one, lora)]) == 0
    _torchrun_train(*_train_args(tiny, tiny["student"], two, lora, "pipeline_model_parallel_size=2"))
    two_to_one = _from_step_2(two, tmp_path / "pp2-to-pp1")
    assert cli(["train", *_train_args(tiny, tiny["student"], two_to_one, lora)]) == 0
    adapters = {}
    for save in (one, two, two_to_one):
        assert [m["step"] for m in _metrics(save)] == [1, 2, 3], save
        for a, b in zip(_metrics(one), _metrics(save), strict=True):
            assert a["active_tokens"] == b["active_tokens"] and b["jsd"] > 0
            assert_layout_close(torch.tensor([b["loss"], b["jsd"], b["sft"], b["grad_norm"]]),
                                torch.tensor([a["loss"], a["jsd"], a["sft"], a["grad_norm"]]),
                                f"{save.name} step {a['step']}")
        assert cli(["export", "--checkpoint", str(save), "--out", str(save / "ad"), "--adapter-only"]) == 0
        adapters[save] = load_file(save / "ad" / "adapter_model.safetensors")
    layers = {int(k.split(".layers.")[1].split(".")[0]) for k in adapters[one]}
    assert layers == {0, 1} and all(adapters[two][k].abs().max() > 0 for k in adapters[one] if "lora_B" in k)
    for save in (two, two_to_one):
        assert_layout_close(adapters[save], adapters[one], f"{save.name} adapter")


@pytest.mark.distributed
def test_vpp2_pp2_matches_pp1(tiny, four, tmp_path):
    """Interleaved 1F1B (virtual_pipeline_model_parallel_size=2 x pipeline_model_parallel_size=2: two one-layer model
    chunks per rank, 4 micro-batches a step in groups of 2), the 4-layer tied student, through the CLI: 3 SGD steps
    (stopped after step 2, resumed from its chunked checkpoint) against 3 at PP=1: per-step losses and grad norms,
    and the trained change of the weights `gkd export` writes from each run's checkpoint (loaded at PP=1); the
    interleaved run's step-2 checkpoint resumed at PP=1 continues the same trajectory."""
    from safetensors.torch import load_file

    from pipeline.cli import main as cli

    one, vpp = tmp_path / "pp1", tmp_path / "vpp2"
    assert cli(["train", *_train_args(tiny, four, one)]) == 0
    for stop in (("exit_after=2",), ()):
        _torchrun_train(*_train_args(tiny, four, vpp, "pipeline_model_parallel_size=2",
                                     "virtual_pipeline_model_parallel_size=2", *stop))
    to_one = _from_step_2(vpp, tmp_path / "vpp2-to-pp1")  # the chunked checkpoint (and SGD momentum) at PP=1
    assert cli(["train", *_train_args(tiny, four, to_one)]) == 0
    a = _metrics(one)
    for save in (vpp, to_one):
        b = _metrics(save)
        assert [m["step"] for m in b] == [1, 2, 3]
        for x, y in zip(a, b, strict=True):
            for key in ("active_tokens", "samples", "real_tokens", "data_position"):
                assert x[key] == y[key], key
            assert y["jsd"] > 0 and y["sft"] > 0
            assert_layout_close(torch.tensor([y["loss"], y["jsd"], y["sft"], y["grad_norm"]]),
                                torch.tensor([x["loss"], x["jsd"], x["sft"], x["grad_norm"]]),
                                f"{save.name} step {x['step']}")
    start = load_file(four / "model.safetensors")
    change = {}
    for save in (one, vpp):
        assert cli(["export", "--checkpoint", str(save), "--out", str(save / "hf")]) == 0
        weights = load_file(save / "hf" / "model.safetensors")
        change[save] = {k: weights[k] - start[k] for k in start}
    assert all(bool(change[one][k].abs().max() > 0) for k in start if "layers.3." in k)  # the last chunk trained
    assert_layout_close(change[vpp], change[one], "vpp: trained change")


@pytest.mark.distributed
@pytest.mark.slow  # 4 processes each; CI: PP=2 x VPP=2 and PP=2 x TP=2 on 2 processes
@pytest.mark.parametrize("layout", [("pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=2",
                                     "tensor_model_parallel_size=2"), ("pipeline_model_parallel_size=4",)],
                         ids=["vpp2 x pp2 x tp2", "pp4"])
def test_four_process_pipelines_match_pp1(tiny, four, tmp_path, layout):
    """4 processes through the CLI, the 4-layer tied student: interleaved 1F1B with the stages' layers and the tied
    embedding's copies split over 2 TP ranks, and 4 one-layer stages (more than two: middle stages that neither embed
    nor hold the loss); 2 SGD steps against 2 at PP=1, step by step."""
    from pipeline.cli import main as cli

    one, many = tmp_path / "pp1", tmp_path / "many"
    assert cli(["train", *_train_args(tiny, four, one, "train_steps=2")]) == 0
    _torchrun_train(*_train_args(tiny, four, many, "train_steps=2", *layout), nproc=4)
    a, b = _metrics(one), _metrics(many)
    assert [m["step"] for m in b] == [1, 2]
    for x, y in zip(a, b, strict=True):
        assert x["active_tokens"] == y["active_tokens"] and y["jsd"] > 0 and y["sft"] > 0
        assert_layout_close(torch.tensor([y["loss"], y["jsd"], y["sft"], y["grad_norm"]]),
                            torch.tensor([x["loss"], x["jsd"], x["sft"], x["grad_norm"]]), f"step {x['step']}")
    assert b[0]["lr"] > 0 and b[0]["grad_norm"] > 0  # step 1 moved the student: step 2 compares trained weights


@pytest.mark.distributed
def test_pp2_routed_teachers_match_pp1(tiny, tmp_path):
    """Routed teachers (`teachers: {A: CACHE, B: CACHE}`, weighted) under PP=2: the per-teacher report entries come
    from the last stage like the others; 2 SGD steps through the CLI against PP=1, per-teacher metrics included."""
    from tiny_cache import build_tiny, random_samples, score_into_cache

    from pipeline.cli import main as cli

    samples = random_samples(16, tiny["vocab"], seed=5)
    tags = [{"task": "A" if i % 2 else "B"} for i in range(16)]
    score_into_cache(tiny["model"], tmp_path / "a", samples, tags=tags)
    score_into_cache(build_tiny(tmp_path / "teacher-b", seed=2), tmp_path / "b", samples, tags=tags)

    def args(save: Path, *extra: str) -> list[str]:
        return [f"student={tiny['student']}", "cache=[]", f"teachers={{A: {tmp_path / 'a'}, B: {tmp_path / 'b'}}}",
                "teacher_tag_key=task", "teacher_weights={B: 0.25}", "micro_batch_size=2", "global_batch_size=8",
                "seq_length=64", "train_steps=2", "warmup_steps=0", "optimizer=sgd", "lr=0.5", "min_lr=0.5",
                f"save_dir={save}", "save_interval=2", "progress=false", *extra]

    assert cli(["train", *args(tmp_path / "pp1")]) == 0
    _torchrun_train(*args(tmp_path / "pp2", "pipeline_model_parallel_size=2"))
    one, two = ([json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                for name in ("pp1", "pp2"))
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        assert set(a) == set(b) and a["active_tokens/A"] > 0 and a["active_tokens/B"] > 0
        for key in ("active_tokens", "active_tokens/A", "active_tokens/B", "samples", "unrouted_samples"):
            assert a[key] == b[key], key
        names = ("loss", "jsd", "jsd/A", "jsd/B", "grad_norm")
        assert_layout_close(torch.tensor([b[n] for n in names]), torch.tensor([a[n] for n in names]),
                            f"step {a['step']}")

# What compat.py patches on the pipeline path, pinned to megatron-core 0.16.1's source: (module, function, the CUDA
# call the patch answers). An upgrade that moves or rewrites one of these fails here, naming what to re-check in
# pipeline/train/parallel/compat.py, instead of failing (or silently running another path) in the torchrun tests.
PIPELINE_CUDA_SPOTS = [
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate_shapes",
     "device=torch.cuda.current_device()"),  # the shapes PP stages exchange first (variable_seq_lengths)
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate",
     "device=torch.cuda.current_device()"),  # the receive buffers
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving",
     'torch.zeros([], dtype=torch.int, device="cuda")'),  # total_num_tokens
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving",
     'torch.zeros([], dtype=torch.int, device="cuda")'),  # total_num_tokens, interleaved 1F1B
    ("megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer", "weight.data.cuda()"),  # tied embeddings across stages
]


@pytest.mark.parametrize("module,function,call", PIPELINE_CUDA_SPOTS, ids=[s[1] for s in PIPELINE_CUDA_SPOTS])
def test_compat_still_covers_the_pipeline_cuda_calls(module, function, call):
    import importlib
    import inspect

    from pipeline.train.parallel import compat

    mod = importlib.import_module(module)
    obj = mod
    for part in function.split("."):
        obj = getattr(obj, part)
    if module in compat._CPU_MODULES:  # patched by rebinding the module's `torch`: the call must still look it up
        assert call in inspect.getsource(obj), f"megatron-core changed {module}.{function}: re-check compat.py"
    else:  # a function-level patch (compat._patch_tied_embedding_setup) wraps the original: read that one
        if not torch.cuda.is_available():
            compat.apply_cpu_compat()
        original = inspect.getclosurevars(obj).nonlocals.get("original", obj)
        assert call in inspect.getsource(original), f"megatron-core changed {module}.{function}: re-check compat.py"
