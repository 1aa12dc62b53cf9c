"""The cycle as tasks with dependencies (pipeline/onpolicy/cycle.py): the strict order at max_staleness=0, the
overlap and its bound at N >= 1, and the refusals of bad settings. No engine: the plan alone, stepped by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.onpolicy.config import STAGES, OnPolicyConfig
from pipeline.onpolicy.cycle import Plan, Task
from pipeline.onpolicy.state import cycle_on_policy, policy_cycle


def _cfg(**kw) -> OnPolicyConfig:
    values = {"num_cycles": 5, "lmbda": 1.0, "offpolicy_cache": None, "offpolicy_dataset": None, **kw}
    return load_config(OnPolicyConfig, None, values)


def _simulate(plan: Plan, seconds: dict[str, float]) -> list[tuple[Task, float, float]]:
    """Run the plan with each stage taking `seconds[stage]` on its role (skips take none): (task, start, end) in
    the order the tasks finish, dispatching as cycle.run_cycles does."""
    done: set[Task] = set()
    running: dict[str, tuple[Task, float, float]] = {}
    now, out = 0.0, []
    while len(done) < len(plan.tasks()):
        ready = plan.ready(done, set(running))
        skips = [t for t in ready if plan.role(t) is None]
        if skips:
            done.add(skips[0])
            out.append((skips[0], now, now))
            continue
        for t in ready:
            running[plan.role(t)] = (t, now, now + seconds[t.stage])
        assert running, "stuck"
        role = min(running, key=lambda r: (running[r][2], running[r][0]))
        t, start, end = running.pop(role)
        now = end
        done.add(t)
        out.append((t, start, end))
    return out


SECONDS = {"export": 0.1, "generate": 3.0, "score": 3.0, "train": 6.0, "eval": 0.5}


def test_staleness_0_is_the_strict_order_one_task_at_a_time():
    plan = Plan(_cfg(num_cycles=3))
    done: set[Task] = set()
    order = []
    while len(done) < len(plan.tasks()):
        ready = plan.ready(done, set())
        assert len(ready) == 1, ready  # never two at once
        done.add(ready[0])
        order.append(ready[0])
    assert order == [Task(c, s) for c in range(3) for s in STAGES]


def test_staleness_0_with_offpolicy_cycles_keeps_the_strict_order():
    cfg = _cfg(num_cycles=8, lmbda=0.5, offpolicy_cache="x")
    draws = [cycle_on_policy(cfg, c) for c in range(8)]
    assert 0 < sum(draws) < 8  # both kinds
    order = [t for t, _, _ in _simulate(Plan(cfg), SECONDS)]
    assert order == [Task(c, s) for c in range(8) for s in STAGES]


def test_staleness_1_overlaps_the_roles_and_respects_the_bound():
    cfg = _cfg(max_staleness=1, num_cycles=6)
    plan = Plan(cfg)
    runs = _simulate(plan, SECONDS)
    when = {t: (s, e) for t, s, e in runs}
    strict = sum(SECONDS.values()) * 6
    makespan = max(e for _, _, e in runs)
    assert makespan < 0.75 * strict, (makespan, strict)  # generate + score (6 s) beside train (6 s)
    assert when[Task(1, "generate")][1] <= when[Task(0, "train")][0]  # cycle 1 samples the initial weights too
    for c in range(2, 6):
        # from cycle 2 on, the sampler works on cycle c while the trainer trains cycle c - 1
        g, t = when[Task(c, "generate")], when[Task(c - 1, "train")]
        assert g[0] < t[1] and t[0] < g[1], (c, g, t)
        # the weights that sampled cycle c: trained by cycle c - 2's end, i.e. 1 version behind cycle c's start
        assert policy_cycle(cfg, c) == c - 1
        assert when[Task(c - 2, "eval")][1] <= when[Task(c, "export")][0]
    # the sampler never runs more than N cycles ahead of the trainer
    for c in range(2, 6):
        assert when[Task(c - 2, "eval")][1] <= when[Task(c, "generate")][0]


@pytest.mark.parametrize("n", [1, 2])
def test_every_cycle_is_sampled_at_most_n_versions_behind(n):
    cfg = _cfg(max_staleness=n, num_cycles=6)
    plan = Plan(cfg)
    when = {t: (s, e) for t, s, e in _simulate(plan, SECONDS)}
    for c in range(6):
        p = policy_cycle(cfg, c)
        assert c - n <= p <= c  # at most n versions behind
        if p > 0:  # the weights it samples with were trained (and exported) before its export starts
            assert when[Task(p - 1, "eval")][1] <= when[Task(c, "export")][0] <= when[Task(c, "generate")][0]
        # and the trainer has not moved past the cycle that the sampler is n ahead of
        assert when[Task(c, "generate")][1] <= when[Task(c, "train")][0]


@pytest.mark.parametrize("value,match", [
    (-1, "max_staleness must be an integer >= 0"),
    ("1.5", "max_staleness"),
    ("x", "max_staleness"),
])
def test_bad_max_staleness_is_refused(value, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(OnPolicyConfig, None, {"lmbda": 1.0, "max_staleness": value})


def test_opd_with_stale_samples_takes_importance_weights_or_is_refused_with_the_reason():
    stale = load_config(OnPolicyConfig, None, {"lmbda": 1.0, "max_staleness": 1, "train.loss": "opd"})
    # the weights need the sampler's logprobs: the sampler records them (and only then: strict runs stay as they were)
    assert stale.opd_weighted and stale.generate_config(Path("r"), "s", 0, 0).logprobs
    with pytest.raises(ConfigError, match=r"max_staleness=1 with train.loss=opd and train.opd_is_cap=null.*bias"):
        load_config(OnPolicyConfig, None, {"lmbda": 1.0, "max_staleness": 1, "train.loss": "opd",
                                           "train.opd_is_cap": None})
    for values in ({"max_staleness": 0, "train.loss": "opd"}, {"max_staleness": 1}):
        cfg = load_config(OnPolicyConfig, None, {"lmbda": 1.0, **values})
        assert cfg.opd_weighted is None and not cfg.generate_config(Path("r"), "s", 0, 0).logprobs


def test_every_executor_takes_overlap():
    for executor in ("local", "ray", "slurm"):
        cfg = load_config(OnPolicyConfig, None, {"lmbda": 1.0, "max_staleness": 1, "executor": executor})
        assert cfg.max_staleness == 1


@pytest.mark.parametrize("key", ["pipeline_model_parallel_size", "tensor_model_parallel_size"])
def test_a_trainer_split_across_processes_is_refused_by_name(key):
    with pytest.raises(ConfigError, match=rf"train.{key}=2: the on-policy trainer runs in one process"):
        load_config(OnPolicyConfig, None, {"lmbda": 1.0, f"train.{key}": 2})
    load_config(OnPolicyConfig, None, {"lmbda": 1.0, f"train.{key}": 1})
