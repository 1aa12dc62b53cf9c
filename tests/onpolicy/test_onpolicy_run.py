"""The on-policy driver end to end with real engines (vLLM sampler + teacher, Megatron trainer) on tiny models.

Run: ``python -m pytest tests/onpolicy`` (~4-6 min on 2 loaded CPU cores; the engines are shared by the module).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from onpolicy_helpers import RG, overrides, start_and_kill
from safetensors.torch import load_file

from pipeline.config import load_config
from pipeline.onpolicy.config import OnPolicyConfig
from pipeline.onpolicy.run import DEFAULT_CONFIG, Stopped, run
from pipeline.onpolicy.state import State, is_on_policy, rollout_keys
from pipeline.store import TeacherCache
from pipeline.store.rollouts import iter_rollouts, rollout_shards

REPO = Path(__file__).resolve().parents[2]


def _cfg(models: dict, out: Path, **kw) -> OnPolicyConfig:
    return load_config(OnPolicyConfig, None, overrides(models, out, **kw))


def _rollouts(out: Path, cycle: int) -> list[dict]:
    return list(iter_rollouts(rollout_shards(out / "rollouts" / f"cycle-{cycle:04d}")))


def _final_weights(out: Path, step: int = 4) -> dict[str, torch.Tensor]:
    return load_file(str(out / "exports" / f"step-{step:07d}" / "model.safetensors"))


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def full(models, engines, tmp_path_factory) -> Path:
    """The uninterrupted 2-cycle on-policy run (weight_sync=reload) every other run is compared with."""
    out = tmp_path_factory.mktemp("full")
    run(_cfg(models, out), engines)
    return out


def test_shipped_config_loads_and_schedule_is_deterministic():
    cfg = load_config(OnPolicyConfig, DEFAULT_CONFIG)
    assert cfg.executor == "local" and cfg.offpolicy_dataset and 0 < cfg.lmbda < 1
    draws = [is_on_policy(cfg.seed, c * cfg.steps_per_generation, cfg.lmbda) for c in range(64)]
    assert draws == [is_on_policy(cfg.seed, c * cfg.steps_per_generation, cfg.lmbda) for c in range(64)]
    assert 0 < sum(draws) < 64  # both kinds occur
    with pytest.raises(ValueError, match="lmbda < 1 needs off-policy data"):
        load_config(OnPolicyConfig, None, {"lmbda": 0.5})


def test_two_cycles_policy_version_fresh_samples_and_cache(full):
    lines = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [m["cycle"] for m in lines] == [-1, 0, 1]
    assert [m["policy_version"] for m in lines[1:]] == [0, 2]
    assert all(m["on_policy"] and m["loss"] > 0 and m["train_tok_s"] > 0 for m in lines[1:])
    assert all(m["heldout_kl"] > 0 for m in lines) and lines[-1]["heldout_kl"] < lines[0]["heldout_kl"]
    state = State.load(full)
    assert (state.cycle, state.stage) == (2, "export")
    r0, r1 = _rollouts(full, 0), _rollouts(full, 1)
    assert {r["policy_version"] for r in r0} == {0} and {r["policy_version"] for r in r1} == {2}
    # Same prompts, same sampling seed (generate_seed): only the weights changed between the cycles.
    assert [r["prompt_id"] for r in r0] == [r["prompt_id"] for r in r1]
    assert [r["completion_ids"] for r in r0] != [r["completion_ids"] for r in r1]
    cache = TeacherCache.open(full / "cache")
    for c in (0, 1):
        keys = rollout_keys(full / "rollouts" / f"cycle-{c:04d}", cache)
        assert keys and set(keys) <= cache.keys()
        view = TeacherCache.open(full / "views" / f"cycle-{c:04d}")
        assert view.keys() == set(keys)  # the trainer saw exactly this cycle's rows
    policy = {s.policy_version for s in cache.iter_samples()}
    assert {0, 2} <= policy


def test_stop_after_stages_and_restart_engine_give_the_same_run(full, models, engines, tmp_path):
    """Stopped after cycle 0's score, then after cycle 1's generate, then finished, with a fresh sampler engine
    per cycle (weight_sync=restart): same rollouts (so in-place reload == fresh engine) and same final weights."""
    cfg = _cfg(models, tmp_path, weight_sync="restart")
    for stop in ("0:score", "1:generate"):
        cfg.stop_after = stop
        with pytest.raises(Stopped):
            run(cfg, engines)
        state = State.load(tmp_path)
        assert (state.cycle, state.stage) == ((0, "train") if stop == "0:score" else (1, "score"))
    cfg.stop_after = None
    run(cfg, engines)
    for c in (0, 1):
        assert [r["completion_ids"] for r in _rollouts(tmp_path, c)] == [r["completion_ids"] for r in _rollouts(full, c)]
    assert _same_weights(_final_weights(tmp_path), _final_weights(full))


def _state(out: Path) -> tuple[int, str] | None:
    try:
        s = json.loads((out / "state.json").read_text())
        return s["cycle"], s["stage"]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_sigkill_during_train_then_rerun_gives_the_same_weights(full, models, engines, tmp_path):
    args = [f"{k}={'null' if v is None else v}" for k, v in overrides(models, tmp_path).items()]
    # Killed right after cycle 1's first optimizer step (step 3; the driver's 3rd train step: cycle 0 made 1 and 2)
    # is logged: mid-train, step 4 and its checkpoint still to come. The driver stops itself there (GKD_PAUSE_AT).
    start_and_kill([sys.executable, "-m", "pipeline.cli", "onpolicy", *args], REPO, tmp_path / "killed.log",
                   "train-step:3")
    assert _state(tmp_path) == (1, "train")
    train = tmp_path / "train"
    assert [json.loads(x)["step"] for x in (train / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (train / "latest").read_text().strip() == "step_0000002"  # step 3 is in no checkpoint: redone
    assert '"cycle": 1' not in (tmp_path / "metrics.jsonl").read_text()
    run(_cfg(models, tmp_path), engines)
    assert _same_weights(_final_weights(tmp_path), _final_weights(full))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["cycle"] for m in lines] == [-1, 0, 1]
    assert [json.loads(x)["step"] for x in (train / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_lmbda0_equals_offpolicy_trainer(models, engines, tmp_path):
    """lmbda=0: every cycle trains on the off-policy cache, resuming its position: equal to one `gkd train`."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from pipeline.train.loop import train

    cfg = _cfg(models, tmp_path / "op", lmbda=0.0, heldout_prompts=None, offpolicy_cache=str(tmp_path / "off"),
               offpolicy_dataset=RG.format(size=6, seed=1))
    lines = run(cfg, engines)
    assert [m["on_policy"] for m in lines] == [False, False]
    assert not (tmp_path / "op" / "rollouts" / "cycle-0000").exists()
    tcfg = cfg.train_config(tmp_path / "plain", [str(tmp_path / "off")], None, None)
    tcfg.save_interval = 100
    train(tcfg)

    def steps(d: Path) -> list[tuple]:
        keys = ("step", "loss", "grad_norm", "lr", "data_position")
        return [tuple(json.loads(x)[k] for k in keys) for x in (d / "metrics.jsonl").read_text().splitlines()]

    assert steps(tmp_path / "op" / "train") == steps(tmp_path / "plain")  # exact floats
    for name, d in (("a.pt", tmp_path / "op" / "train"), ("b.pt", tmp_path / "plain")):
        dcp_to_torch_save(d / "step_0000004", tmp_path / name)
    wa, wb = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa if torch.is_tensor(wa[k]))


def test_lora_student_ships_only_the_adapter(models, engines, tmp_path):
    """lora_rank > 0: the trainer trains an adapter, each export is a peft folder (no full weights), the sampler
    keeps the base and applies the newest adapter by a fresh LoRARequest; cycle 1 samples differ from cycle 0's."""
    lines = run(_cfg(models, tmp_path, lora_rank=8, lora_alpha=16.0, lr=5e-2), engines)
    export = tmp_path / "exports" / "step-0000004"
    assert sorted(p.name for p in export.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"] == str(models["student"])
    meta = json.loads((tmp_path / "train" / "step_0000004" / "trainer.json").read_text())
    assert meta["lora"]["rank"] == 8
    assert engines.sampler_lora_rank == 8 and engines.lora_request is not None
    assert engines.lora_request.lora_path == str(tmp_path / "exports" / "step-0000002")  # cycle 1's policy
    r0, r1 = _rollouts(tmp_path, 0), _rollouts(tmp_path, 1)
    assert [r["prompt_id"] for r in r0] == [r["prompt_id"] for r in r1]
    assert [r["completion_ids"] for r in r0] != [r["completion_ids"] for r in r1]  # the adapter reached the sampler
    assert lines[-1]["heldout_kl"] < lines[0]["heldout_kl"]


def test_onpolicy_loss_opd_two_cycles(models, engines, tmp_path):
    """loss=opd through the driver (the key reaches the trainer): two cycles on the student's own samples, each
    trained with the sampled-token estimator; the held-out KL(teacher || student) on the teacher's top-k + tail
    falls, and the trainer reports its per-token reverse-KL estimate."""
    lines = run(_cfg(models, tmp_path, loss="opd"), engines)
    assert [m["cycle"] for m in lines] == [-1, 0, 1]
    assert lines[-1]["heldout_kl"] < lines[0]["heldout_kl"]
    train = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(train) == 4 and all("opd_kl" in m and m["jsd"] == 0.0 for m in train)  # student rows only: no GKD


def test_exact_teacher_cache_on_policy(models, engines, tmp_path):
    """score.teacher_rows=hidden through the driver: the teacher role's engine is vLLM's pooling runner (the one
    `gkd score teacher_rows=hidden` opens), each cycle's view is a hidden-state cache holding exactly the cycle's
    rows and the teacher's output layer, and the trainer trains the exact divergence from it (no top-k anywhere)."""
    cfg = _cfg(models, tmp_path, teacher_rows="hidden", heldout_prompts=None)
    lines = run(cfg, engines)
    assert [m["cycle"] for m in lines] == [0, 1]
    assert all(m["scored"] == m["samples"] == m["view_rows"] == 8 for m in lines), lines
    cache = TeacherCache.open(tmp_path / "cache")
    assert cache.descriptor.hidden_rows and cache.descriptor.k == 0
    for cycle in (0, 1):
        view = TeacherCache.open(tmp_path / "views" / f"cycle-{cycle:04d}")
        assert view.descriptor.hidden_rows and (view.root / view.descriptor.hidden["output_layer"]).exists()
    train = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(train) == 4 and all(m["jsd"] > 0.01 and m["active_tokens"] > 0 for m in train), train
