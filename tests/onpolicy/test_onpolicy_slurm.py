"""The on-policy driver's Slurm executor (pipeline/onpolicy/slurm.py).

    pytest tests/onpolicy/test_onpolicy_slurm.py -m "not slurm"     # the pure parts, seconds
    pytest tests/onpolicy/test_onpolicy_slurm.py -s                  # + a real local Slurm (~9 min quiet on 2 cores)

The `slurm` tests run real jobs (vLLM sampler and teacher, Megatron trainer) on tiny models against the session's
local cluster (`slurm_cluster`, tests/conftest.py) and compare with the local executor on the same config: equal
final weights (to float noise, see _assert_same_training). Each job pays Python + vLLM/Megatron start-up (~20-40 s
here), so the runs are 2 cycles of 2 generate and 2 score tasks, and one run checks both the strict executor's
equality with the local one and the resume of a killed driver (test_driver_killed_then_rerun).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from onpolicy_helpers import RG, overrides, start_and_kill
from safetensors.torch import load_file
from scored_rows import make_descriptor, make_row
from tolerance import assert_layout_close

from pipeline.config import ConfigError, load_config
from pipeline.onpolicy.config import OnPolicyConfig
from pipeline.onpolicy.run import run
from pipeline.onpolicy.slurm import JobFailed, SlurmDriver
from pipeline.onpolicy.slurm_tasks import job_name, run_tag, task_main
from pipeline.onpolicy.state import State, build_view, rollout_keys
from pipeline.slurm.queue import ACTIVE, answered_states
from pipeline.store import TeacherCache
from pipeline.store.rollouts import rollout_row, rollout_shards, write_rollouts

REPO = Path(__file__).resolve().parents[2]
SLURM = dict(executor="slurm", slurm_poll_s=0.5, slurm_stage_timeout_s=900.0, heldout_prompts=None)
# SGD: weights after Adam steps cannot be compared across process layouts (tests/tolerance.py, rule 1)
SGD = dict(train_extra={"optimizer": "sgd"}, lr=0.3, min_lr=0.03)


def _cfg(models: dict, out: Path, **kw) -> OnPolicyConfig:
    kw = {**SGD, **kw}
    return load_config(OnPolicyConfig, None, overrides(models, out, **kw))


def _final_weights(out: Path, step: int = 4) -> dict[str, torch.Tensor]:
    return load_file(str(out / "exports" / f"step-{step:07d}" / "model.safetensors"))


def _initial_weights(models: dict) -> dict[str, torch.Tensor]:
    return load_file(str(models["student"] / "model.safetensors"))


def _assert_same_training(a: dict, b: dict, start: dict | None = None) -> None:
    """The two runs trained the same weights, under the cross-layout rule of tests/tolerance.py: the runs use SGD
    (`_cfg`), and what is compared is what training changed (final − initial weights; a LoRA adapter's B starts at
    zero, so an adapter is compared as it is), since the initial weights are identical by construction and would
    otherwise dilute the comparison."""
    start = start or {}
    assert_layout_close({k: v - start.get(k, 0) for k, v in b.items()}, {k: v - start.get(k, 0) for k, v in a.items()},
                        "trained weights")


def _cache_keys(cache: Path) -> list[str]:
    c = TeacherCache.open(cache)
    return [k for p in c.shard_paths() for k in pq.read_table(p, columns=["key"]).column("key").to_pylist()]


def _sample_ids(out: Path, cycle: int) -> list[str]:
    from pipeline.store.rollouts import iter_rollouts

    return sorted(r["sample_id"] for r in iter_rollouts(rollout_shards(out / "rollouts" / f"cycle-{cycle:04d}")))


# -- pure logic, no Slurm ------------------------------------------------------------------------------------------


def test_slurm_knobs_are_validated():
    for bad, message in (("slurm_extra=--array=0-3 --qos=high", "must not set --array"),
                         ("slurm_extra=--dependency=afterok:1", "must not set --dependency"),
                         ("slurm_extra=--account proj", "proj is not an option"),
                         ("slurm_extra=--qos='high", "cannot split"),
                         ("slurm_generate_shards=0", "slurm_generate_shards must be >= 1"),
                         ("slurm_cpus_per_task=0", "slurm_cpus_per_task must be >= 1"),
                         ("slurm_time=2:00:00", "got the number 7200")):
        with pytest.raises(ConfigError, match=message):
            load_config(OnPolicyConfig, None, ["lmbda=1", "executor=slurm", bad])
    cfg = load_config(OnPolicyConfig, None, ["lmbda=1", "executor=slurm", "slurm_extra=--qos=high -A=p",
                                             "slurm_time='2:00:00'"])
    assert cfg.slurm_time == "2:00:00" and cfg.slurm_extra == "--qos=high -A=p" and cfg.slurm_partition is None


def test_job_names():
    tag = run_tag("runs/onpolicy")
    assert tag == run_tag(Path("runs/onpolicy").resolve()) and tag != run_tag("runs/other")
    assert job_name(tag, "score", 3) == f"gkd-onpolicy-{tag}-c0003-score"
    assert job_name(tag, "setup", -1) == f"gkd-onpolicy-{tag}-setup"


def test_job_scripts(models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(models, tmp_path / "run", **SLURM, slurm_partition="gpu", slurm_gres="gpu:1", slurm_time="1:00:00",
               slurm_cpus_per_task=4, slurm_extra="--qos=high", slurm_generate_shards=3)
    driver = SlurmDriver(cfg)
    text = driver.script("generate", 1).read_text()
    for line in ("#SBATCH --array=0-2", "#SBATCH --partition=gpu", "#SBATCH --gres=gpu:1", "#SBATCH --time=1:00:00",
                 "#SBATCH --cpus-per-task=4", "#SBATCH --qos=high", "#SBATCH --kill-on-invalid-dep=yes",
                 f"#SBATCH --chdir={tmp_path}", f"#SBATCH --job-name=gkd-onpolicy-{driver.tag}-c0001-generate",
                 "NUM_SHARDS=3\n"):
        assert line in text, line
    assert (f"-m pipeline onpolicy --config {driver.config_file} --stage generate --cycle 1 "
            '--shard "$SLURM_ARRAY_TASK_ID" --num-shards "$NUM_SHARDS"') in text
    train = driver.script("train", 1).read_text()
    assert "--array" not in train and "#SBATCH --ntasks=1" in train
    assert train.rstrip().endswith(f"-m pipeline onpolicy --config {driver.config_file} --stage train --cycle 1")
    assert f"--output={driver.log_dir}/gkd-onpolicy-{driver.tag}-c0001-train-%j.log" in train


def test_task_status_and_shard_checks(models, tmp_path, capsys):
    cfg = _cfg(models, tmp_path / "run", **SLURM)
    assert task_main(cfg, "generate", 1, None, None, status=True) == 1
    assert "2 of 2 tasks missing; resubmit with:\n--array=0-1" in capsys.readouterr().out
    assert task_main(cfg, "export", 0, None, None, status=True) == 0  # step 0: the student folder itself
    with pytest.raises(ConfigError, match="differs from the config's 2 generate tasks"):
        task_main(cfg, "generate", 0, 0, 5)
    with pytest.raises(ConfigError, match="outside"):
        task_main(cfg, "train", 2, None, None)


def test_view_is_independent_of_how_the_cache_is_split(tmp_path):
    """Same rows scored by one task or spread over three shards (an array): byte-identical view shards, so the
    trainer's data order is the same. Rows stay encoded: decoded values equal the cache's."""
    d = make_descriptor(k=8, vocab=500)
    rng = np.random.default_rng(0)
    rows = [make_row(rng, d, length=int(rng.integers(4, 20)), prompt_len=3, source="student") for _ in range(9)]
    one = TeacherCache.create_or_open(tmp_path / "one", d)
    one.write_shard("scored-a-00000-of-00001-p0000", rows)
    three = TeacherCache.create_or_open(tmp_path / "three", d)
    for i in range(3):
        three.write_shard(f"scored-b-{i:05d}-of-00003-p0000", rows[i::3])
    keys = [r["key"] for r in rows][1:]  # one row is not this cycle's
    views = []
    for name, cache in (("one", one), ("three", three)):
        shards, lost = build_view(cache, keys, tmp_path / f"view-{name}")
        assert lost == 0 and len(shards) == 1
        views.append(Path(shards[0]))
        assert build_view(cache, keys, tmp_path / f"view-{name}") == (shards, 0)  # complete: a no-op
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in views]
    assert digest[0] == digest[1]
    got = list(TeacherCache.open(tmp_path / "view-three").iter_samples())
    assert [s.key for s in got] == keys
    cached = {s.key: s for s in three.iter_samples()}
    for s in got:
        for field in ("topk_ids", "topk_logprobs", "tail_logprobs", "actual_logprobs", "actual_ranks"):
            assert np.array_equal(getattr(s, field), getattr(cached[s.key], field)), field


def test_rollout_keys_in_prompt_order_whatever_the_sharding(tmp_path):
    rng = np.random.default_rng(1)
    rows = [rollout_row(prompt_id=f"q{i // 2}", prompt_ids=rng.integers(3, 99, 4).tolist(),
                        completion_ids=rng.integers(3, 99, 5).tolist(), source="student", policy_version=0)
            for i in range(8)]
    write_rollouts(tmp_path / "one" / "rollouts-00000-of-00001.parquet", rows)
    write_rollouts(tmp_path / "two" / "rollouts-00000-of-00002.parquet", [r for r in rows if r["prompt_id"] in ("q1", "q3")])
    write_rollouts(tmp_path / "two" / "rollouts-00001-of-00002.parquet", [r for r in rows if r["prompt_id"] in ("q0", "q2")])
    cache = TeacherCache(tmp_path, make_descriptor(k=4, vocab=100))
    order = ["q0", "q1", "q2", "q3"]
    want = rollout_keys(tmp_path / "one", cache)
    assert rollout_keys(tmp_path / "two", cache, order) == want != rollout_keys(tmp_path / "two", cache)


# -- against a real local Slurm --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_run(models, engines, tmp_path_factory) -> Path:
    """The local executor on the config the Slurm runs use (2 on-policy cycles)."""
    out = tmp_path_factory.mktemp("local")
    run(_cfg(models, out, heldout_prompts=None), engines)
    return out


@pytest.mark.slurm
@pytest.mark.slow  # CI: the Slurm executor's equality and resume below, and overlap + LoRA on the local executor
def test_lora_student_overlapped_under_slurm_equals_local(models, slurm_cluster, tmp_path, monkeypatch):
    """lora_rank > 0 and max_staleness=1 through the Slurm jobs: the export job writes the peft adapter, the
    generate tasks sample with it (LoRARequest on the base), cycle 1 is generated and scored while cycle 0 trains
    (the recorded task times), on samples one version old, and the final adapter equals the local executor's at the
    same staleness (its roles in processes of their own): the plan fixes every task's inputs, whatever the timing."""
    monkeypatch.chdir(tmp_path)
    # fresh sampling seeds per cycle: cycle 1, sampled with cycle 0's weights, would otherwise repeat its samples
    kw = {"lora_rank": 8, "lora_alpha": 16.0, "lr": 1.0, "max_staleness": 1, "generate_seed": None}
    run(_cfg(models, tmp_path / "local", heldout_prompts=None, **kw))
    run(_cfg(models, tmp_path / "run", **SLURM, **kw))
    adapters = [load_file(str(tmp_path / name / "exports" / "step-0000004" / "adapter_model.safetensors"))
                for name in ("local", "run")]
    assert adapters[0]
    _assert_same_training(*adapters)
    assert not (tmp_path / "run" / "exports" / "step-0000004" / "model.safetensors").exists()
    for c in (0, 1):
        assert _sample_ids(tmp_path / "run", c) == _sample_ids(tmp_path / "local", c)
    state = State.load(tmp_path / "run")
    c0, c1 = state.cycles["0"], state.cycles["1"]
    assert [c0["staleness"]["max"], c1["staleness"]["max"]] == [0, 1]  # cycle 1 trained on version-0 samples
    # overlap: cycle 1's generate was dispatched before cycle 0's train ended (the plan allows it at staleness 1)
    assert c1["tasks"]["generate"]["dispatched"] < c0["tasks"]["train"]["end"], (c0["tasks"], c1["tasks"])
    assert c1["tasks"]["generate"]["start"] < c0["tasks"]["train"]["end"]
    assert len(state.jobs["1:generate"]) == 1 and "1:export" not in state.jobs  # cycle 1 samples with step 0


@pytest.mark.slurm
def test_driver_killed_then_rerun(models, local_run, slurm_cluster, tmp_path, monkeypatch):
    """SIGKILL the driver right after it queued cycle 0's chain (jobs queued and running), forget the train job's id
    as if the kill had come between sbatch and the state write, rerun: the rerun adopts the queued jobs instead of
    submitting them again, finishes, and equals the local executor (weights, samples, cache keys), with the jobs
    and the strict order the Slurm executor gives. With held-out prompts (a setup job). One Slurm run checks both
    (the resume and the executor's equality): each costs ~3 min of job start-ups here."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    kw = {**SGD, **SLURM, "heldout_prompts": RG.format(size=2, seed=2)}
    args = [f"{k}={'null' if v is None else v}" for k, v in overrides(models, out, **kw).items()]
    # The driver's 8th state write records cycle 0's train job (1: the setup job, 2: setup done, 3: export 0 done
    # (step 0: no job), 4-5: generate 0 submitted, done, 6-7: score 0; the jobs write no state.json): it stops itself
    # right there (GKD_PAUSE_AT), so the kill lands after that write and before the driver waits on it, however busy
    # the machine.
    start_and_kill([sys.executable, "-m", "pipeline", "onpolicy", *args], tmp_path, tmp_path / "killed.log",
                   "onpolicy-state:8")
    state = State.load(out)
    assert state.setup_done and sorted(state.jobs) == ["0:generate", "0:score", "0:train", "setup"], state.jobs
    (train,) = state.jobs.pop("0:train")
    # still queued or running (a job's start-up alone takes far longer than the kill), or, on a machine slow enough
    # that it ended meanwhile, its outputs on disk: then the rerun must submit nothing for it either
    queued = any(s in ACTIVE for s in answered_states(train["id"]).values())
    state.save(out)

    lines = run(_cfg(models, out, **kw))
    assert [m["cycle"] for m in lines] == [-1, 0, 1] and lines[-1]["heldout_kl"] < lines[0]["heldout_kl"]
    assert all(m["on_policy"] and m["loss"] > 0 for m in lines[1:])
    # the Slurm executor equals the local one: the same training, the same samples, the same rows scored once
    _assert_same_training(_final_weights(out), _final_weights(local_run), _initial_weights(models))
    for c in (0, 1):
        assert [p.name for p in rollout_shards(out / "rollouts" / f"cycle-{c:04d}")] == [
            "rollouts-00000-of-00002.parquet", "rollouts-00001-of-00002.parquet"]
        assert _sample_ids(out, c) == _sample_ids(local_run, c)  # the same samples as one generate task
    keys = _cache_keys(out / "cache")
    assert len(keys) == len(set(keys))  # nothing scored twice
    # exactly the local run's rows (the cycles') and the held-out set's (the setup job's; the local run has none)
    heldout = rollout_keys(out / "rollouts" / "heldout", TeacherCache.open(out / "cache"))
    assert heldout and set(keys) == set(_cache_keys(local_run / "cache")) | set(heldout)
    state = State.load(out)
    assert (state.cycle, state.stage) == (2, "export")
    assert state.cycles["1"]["done"] == ["export", "generate", "score", "train", "eval"]
    jobs = state.jobs
    # found by its name, not submitted again
    assert jobs.get("0:train", []) == ([{"id": train["id"], "adopted": True}] if queued else [])
    # no export job (the eval of cycle 0 exported step 2 already) and no eval job (each runs in its train job)
    assert sorted(set(jobs) - {"0:train"}) == ["0:generate", "0:score", "1:generate", "1:score", "1:train", "setup"]
    assert all(len(jobs[k]) == 1 for k in ("setup", "0:generate", "0:score", "1:generate", "1:score", "1:train"))
    for c in (0, 1):
        (gen,), (score,) = (jobs[f"{c}:{s}"] for s in ("generate", "score"))
        assert gen["array"] == score["array"] == "0-1"
        # from the job-completion log: squeue forgets a job 600 s (MinJobAge) after it ends, and a loaded machine
        # takes longer than that to get here from cycle 0's generate
        assert slurm_cluster.finished(gen["id"]) == {0: "COMPLETED", 1: "COMPLETED"}
    assert jobs["1:train"][0]["array"] is None
    # the strict order, in the cycle the rerun ran whole: each task dispatched after the one before it ended
    times = state.cycles["1"]["tasks"]
    for before, after in zip(("export", "generate", "score", "train"), ("generate", "score", "train", "eval"), strict=True):
        assert times[after]["dispatched"] >= times[before]["end"], (before, after, times)


@pytest.mark.slurm
def test_failed_job_and_bad_options_are_clear_errors(models, slurm_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad, words in (({"slurm_partition": "nosuch"}, ("nosuch", "slurm_partition", "sbatch")),
                       ({"slurm_extra": "--bogus-option=1"}, ("--bogus-option", "slurm_extra"))):
        with pytest.raises(ConfigError) as e:
            run(_cfg(models, tmp_path / "bad", **SLURM, **bad))
        assert all(w in str(e.value) for w in words), str(e.value)
        assert State.load(tmp_path / "bad").jobs == {}  # nothing was queued
    # a generate task that fails (prompts that do not exist): the error names the job, stage, cycle and log
    out = tmp_path / "fail"
    with pytest.raises(JobFailed) as e:
        run(_cfg(models, out, **SLURM, prompts=str(tmp_path / "missing.jsonl")))
    msg = str(e.value)
    jobs = State.load(out).jobs
    gen = jobs["0:generate"][0]["id"]
    assert msg.startswith(f"cycle 0, stage generate: job {gen}_0 FAILED") and "--array=0-1 missing" in msg, msg
    log = out / "slurm" / "logs" / f"gkd-onpolicy-{run_tag(out)}-c0000-generate-{gen}_0.log"
    assert f"log: {log}" in msg and "missing.jsonl" in msg and "prompt source not found" in log.read_text()
    assert sorted(jobs) == ["0:generate"]  # nothing after it was submitted
