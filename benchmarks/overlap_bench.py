"""Overlapped on-policy cycles (issue 47): max_staleness=1 against the strict order, on the local executor.

    python -m benchmarks.run --only overlap [--overlap-parts schedule,quality,opd,seeds,lr]     (~2.5 h on 2 CPU cores)

The on-policy bench's student, teacher and settings (benchmarks/onpolicy_bench.py: SmolLM2 6-layer student,
SmolLM2-135M-Instruct teacher, 8 prompts x n=2 per cycle, 2 steps per cycle, held-out KL every cycle), in two parts
(`PARTS`; one left out keeps its stored results). The schedule: `CYCLES` cycles, three runs in this order:

1. real-0: max_staleness=0, the real tiny vLLM engines, each engine wrapped so that what its `generate` returned is
   recorded (sampler: by prompt token ids and request seed; teacher: by token ids);
2. replay-0 and 3. replay-1: the same cycles with the sampler and the teacher replayed from run 1's record, paced
   at one fixed tokens/s (generated tokens for the sampler, scored positions for the teacher; the wait is a sleep,
   so the stand-ins use no CPU), while the trainer trains and evaluates for real. The pace is chosen from run 1 so
   that generate + score time = train + eval time of a cycle: the regime where overlap can halve the wall time.
   Replayed, the staleness-1 run samples what the strict run's policy sampled (its own, staler policy is not
   consulted): these two runs measure the schedule, not the learning.

The quality (the learning): `QUALITY_CYCLES` cycles (the on-policy bench's count) with real engines, strict and at
max_staleness=1 (one process per role, each opening its own engines); the held-out KL every cycle (on the initial
student's samples of the held-out prompts, as the on-policy bench), then each final student sampling the held-out
prompts itself and judged on its own samples (the on-policy objective: onpolicy_bench._final_samples_kl).
The opd part: the same for loss=opd, with and without its importance weights at staleness 1 (`opd`).
The seeds part: the quality part's two runs again under other seeds (`SEEDS`: sampling, trainer seed, the held-out
samples), so the held-out ratio's 5 % goal can be read against how far the ratio moves with the seed alone.
The lr part: the three seeds' strict and staleness-1 runs again at a third of the learning rate (`LR`): a smaller
policy change per cycle, the lever a stale cycle's cost should shrink with.

Two cores are shared by every process here (and by other users of the machine), so the trainer's torch threads are
set to a role process's share (`cpu_count // 3`, what local.RoleProcesses gives each role) in the strict runs too:
both schedules train at the same speed. Every run has a cache of its own (a shared one would make the second run
score nothing). Wall times are read from state.json: the cycles' wall is the first task's dispatch to the last
task's end; a role's busy time is the sum of its tasks' end - start (trainer: export, train, eval).
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.onpolicy_bench import _config
from benchmarks.scorework_bench import Replay
from pipeline.onpolicy.config import STAGES
from pipeline.onpolicy.engines import Engines

CYCLES = 3  # the schedule's runs: three of 3 cycles fit the 2 shared, loaded cores in ~20 min
QUALITY_CYCLES = 6  # the on-policy bench's 12 steps: after 3 cycles the held-out KL is still above the untrained one
PARTS = ("schedule", "quality", "opd", "seeds", "lr")
SEEDS = (1235, 1236)  # beside the quality part's 1234 (the config's default seed)
LR = (1.0e-4, 1.0e-5)  # the lr part's train.lr and train.min_lr: a third of the on-policy bench's (3e-4, 3e-5)
ROLES = ("sampler", "teacher", "trainer")
ROLE_OF = {"export": "trainer", "generate": "sampler", "score": "teacher", "train": "trainer", "eval": "trainer"}


# -- recording and replaying the engines ----------------------------------------------------------------------------


def _key(prompt, params, i: int) -> tuple:
    """A request's identity: its token ids, and for a sampler request (a list of SamplingParams) its seed."""
    ids = tuple(prompt["prompt_token_ids"])
    return (ids, params[i].seed) if isinstance(params, list) else ids


class Recorder:
    """Wraps an open vLLM LLM; keeps what each request returned, in plain picklable objects."""

    def __init__(self, llm, into: dict) -> None:
        self.llm, self.into, self.llm_engine = llm, into, llm.llm_engine

    def generate(self, prompts, params, use_tqdm=False, **kw):
        outs = self.llm.generate(prompts, params, use_tqdm=use_tqdm, **kw)
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            self.into[_key(p, params, i)] = SimpleNamespace(
                prompt_token_ids=list(o.prompt_token_ids), prompt_logprobs=o.prompt_logprobs,
                outputs=[SimpleNamespace(token_ids=list(c.token_ids), finish_reason=c.finish_reason, text=c.text,
                                         logprobs=c.logprobs) for c in o.outputs])
        return outs


def _model_config(llm) -> SimpleNamespace:
    mc = llm.llm_engine.model_config
    return SimpleNamespace(dtype=mc.dtype, quantization=getattr(mc, "quantization", None),
                           max_model_len=mc.max_model_len)


class RecordingEngines(Engines):
    """The real engines, each call's outputs recorded (`save` writes them for ReplayEngines)."""

    def __init__(self) -> None:
        super().__init__()
        self.record: dict = {"sampler": {}, "teacher": {}, "model_config": {}}

    def student(self, cfg, model_dir):
        llm, sync_s, lora = super().student(cfg, model_dir)
        self.record["model_config"]["sampler"] = _model_config(llm)
        return Recorder(llm, self.record["sampler"]), sync_s, lora

    def scorer(self, cfg, teacher):
        llm = super().scorer(cfg, teacher)
        self.record["model_config"]["teacher"] = _model_config(llm)
        return Recorder(llm, self.record["teacher"])

    def save(self, path: Path) -> dict:
        path.write_bytes(pickle.dumps(self.record))
        return {"sampler_tokens": sum(len(c.token_ids) for o in self.record["sampler"].values() for c in o.outputs),
                "teacher_tokens": sum(len(o.prompt_token_ids) for o in self.record["teacher"].values())}


class SamplerReplay(Replay):
    """The student sampler replayed: by prompt ids and seed, paced on the tokens it generated."""

    def __init__(self, outputs: dict, model_config, pace: float | None) -> None:
        super().__init__(outputs, model_config, pace)
        self.llm_engine = SimpleNamespace(model_config=model_config)

    def generate(self, prompts, params, use_tqdm=False, **kw):
        t0 = time.perf_counter()
        outs = [self.outputs[_key(p, params, i)] for i, p in enumerate(prompts)]
        if self.pace:
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            time.sleep(max(0.0, tokens / self.pace - (time.perf_counter() - t0)))
        return outs


class ReplayEngines:
    """Engines' interface (student, scorer, close) answered from a RecordingEngines record, paced at `pace`
    tokens/s. Module-level and built from a path: `functools.partial(ReplayEngines, path, pace)` is what
    local.run_local's `role_engines` sends to the role processes."""

    def __init__(self, path: str, pace: float | None) -> None:
        rec = pickle.loads(Path(path).read_bytes())
        mc = rec["model_config"]
        self.sampler = SamplerReplay(rec["sampler"], mc["sampler"], pace)
        self.teacher = Replay(rec["teacher"], mc["teacher"], pace)  # the score bench's replayed teacher

    def student(self, cfg, model_dir):
        return self.sampler, 0.0, None

    def scorer(self, cfg, teacher):
        return self.teacher

    def close(self) -> None:
        pass


# -- the runs ---------------------------------------------------------------------------------------------------------


def _keep(out: dict, name: str, res: dict) -> None:
    """A run's results, also printed (a later run's failure keeps what was measured in the log)."""
    out["runs"][name] = res
    print(f"overlap bench, {name}: " + json.dumps({k: v for k, v in res.items() if k != "tasks"}), flush=True)


def _cfg(work: Path, name: str, staleness: int, cycles: int, **extra):
    return _config(work, name, 1.0, cycles, 2, 0, cache=str(work / name / "cache"), max_staleness=staleness, **extra)


def _one(work: Path, name: str, staleness: int, cycles: int, engines, role_engines=Engines, cfg=None) -> dict:
    from pipeline.onpolicy.local import run_local

    cfg = cfg or _cfg(work, name, staleness, cycles)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    lines = run_local(cfg, engines, role_engines)
    wall = time.perf_counter() - t0
    state = json.loads((work / name / "state.json").read_text())
    tasks = [t for c in sorted(state["cycles"], key=int) for t in state["cycles"][c].get("tasks", {}).values()]
    first, last = min(t["dispatched"] for t in tasks), max(t["end"] for t in tasks)
    busy = {r: sum(t["end"] - t["start"] for t in tasks if t["role"] == r) for r in ROLES}
    per_stage = {s: round(sum(c.get("tasks", {}).get(s, {}).get("end", 0) - c.get("tasks", {}).get(s, {}).get("start", 0)
                              for c in state["cycles"].values()), 2) for s in STAGES}
    kl = [m["heldout_kl"] for m in lines if "heldout_kl" in m]
    return {"max_staleness": staleness, "run_wall_s": round(wall, 1), "cycles_wall_s": round(last - first, 1),
            "busy_s": {r: round(b, 1) for r, b in busy.items()},
            "idle_fraction": {r: round(1 - b / (last - first), 3) for r, b in busy.items()},
            "stage_seconds": per_stage, "heldout_kl": kl, "final_heldout_kl": kl[-1] if kl else None,
            "staleness": [m.get("staleness") for m in lines if m.get("cycle", -1) >= 0],
            "load_start": round(load0, 2), "load_end": round(os.getloadavg()[0], 2),
            "tasks": {c: {s: {k: v for k, v in t.items() if k != "role"} for s, t in info.get("tasks", {}).items()}
                      for c, info in state["cycles"].items()}}


def _cycle_tokens(out: Path) -> int:
    """The replayed engines' paced tokens over a run's cycles (not its held-out set): each rollout's generated
    tokens (the sampler) and its whole sequence (the teacher scores prompt + completion)."""
    from pipeline.store.rollouts import iter_rollouts, rollout_shards

    return sum(len(r["prompt_ids"]) + 2 * len(r["completion_ids"]) for d in (out / "rollouts").glob("cycle-*")
               for r in iter_rollouts(rollout_shards(d)))


def _trainer_threads() -> int:
    return max(1, (os.cpu_count() or 1) // len(ROLES))  # a role process's share (module doc)


def schedule(work: Path, cycles: int = CYCLES) -> dict:
    """Runs 1-3 (module doc): the strict real run recorded, then both schedules replayed."""
    import torch

    work.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    share = _trainer_threads()
    torch.set_num_threads(share)  # the trainer's share, as a role process gets it (module doc)
    out: dict = {"cycles": cycles, "steps": cycles * 2, "trainer_threads": share, "runs": {}}
    try:
        rec = RecordingEngines()
        try:
            _keep(out, "real-0", _one(work, "real-0", 0, cycles, rec))
        finally:
            rec.close()
        path = work / "recorded.pkl"
        out["recorded"] = rec.save(path)
        # the pace: the cycles' generated + scored tokens in the time of their export + train + eval
        out["cycle_tokens"] = tokens = _cycle_tokens(work / "real-0")
        out["pace_tok_s"] = pace = round(tokens / out["runs"]["real-0"]["busy_s"]["trainer"], 1)
        factory = functools.partial(ReplayEngines, str(path), pace)
        for name, n in (("replay-0", 0), ("replay-1", 1)):
            _keep(out, name, _one(work, name, n, cycles, factory(), factory))
    finally:
        torch.set_num_threads(threads)
    runs = out["runs"]
    out["wall_ratio"] = runs["replay-1"]["cycles_wall_s"] / runs["replay-0"]["cycles_wall_s"]
    out["run_wall_ratio"] = runs["replay-1"]["run_wall_s"] / runs["replay-0"]["run_wall_s"]
    r = runs["replay-0"]
    out["limit_ratio"] = max(r["busy_s"]["sampler"] + r["busy_s"]["teacher"], r["busy_s"]["trainer"]) / sum(
        r["busy_s"].values())
    out["fill_bound"] = (cycles + 1) / (2 * cycles)  # G + S = T: strict 2CT, overlapped (G + S) + CT at best
    return out


def _learn(out: dict, work: Path, cfgs: dict, cycles: int) -> dict:
    """The frame of the learning parts (quality, opd, seeds): each config run in turn, its results kept in
    out["runs"] (a strict one on the shared engines, a staleness >= 1 one in role processes that open their own),
    then each final student judged on its own samples of the held-out prompts. Returns that KL by run name."""
    import torch

    from benchmarks.onpolicy_bench import _final_samples_kl

    work.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(_trainer_threads())
    engines = Engines()  # the strict runs', then the final students' samples and scores
    try:
        for name, cfg in cfgs.items():
            strict = cfg.max_staleness == 0
            _keep(out, name, _one(work, name, cfg.max_staleness, cycles, engines if strict else Engines(), cfg=cfg))
        own = _final_samples_kl(cfgs, engines, cross=False)
    finally:
        engines.close()
        torch.set_num_threads(threads)
    return {name: own[f"{name} on {name}"] for name in cfgs}


def quality(work: Path, cycles: int = QUALITY_CYCLES) -> dict:
    """The learning at staleness 1 against the strict order, real engines (module doc)."""
    out: dict = {"cycles": cycles, "steps": cycles * 2, "runs": {}}
    cfgs = {name: _cfg(work, name, n, cycles) for name, n in (("real-0", 0), ("real-1", 1))}
    out["own_samples_kl"] = _learn(out, work, cfgs, cycles)
    runs = out["runs"]
    out["kl_ratio"] = runs["real-1"]["final_heldout_kl"] / runs["real-0"]["final_heldout_kl"]
    out["own_kl_ratio"] = out["own_samples_kl"]["real-1"] / out["own_samples_kl"]["real-0"]
    return out


def opd(work: Path, cycles: int = QUALITY_CYCLES) -> dict:
    """loss=opd (the sampled-token reverse KL) at staleness 1 against its strict order, real engines, three runs:
    opd-0 strict; opd-1 at max_staleness=1 with its importance weights (train.opd_is_cap, default 2: the sampler
    records its logprobs, each stale token weighted by min(s/b, 2)); opd-1-plain, the control, at max_staleness=1
    without them (opd_is_cap null, which `gkd onpolicy` refuses: the config is built past that check here, so the
    sampler records nothing and every weight is 1). Held-out KL as in `quality`, and each final student on its own
    samples."""
    import dataclasses

    out: dict = {"cycles": cycles, "steps": cycles * 2, "runs": {}}
    loss = {"train.loss": "opd"}
    cfgs = {"opd-0": _cfg(work, "opd-0", 0, cycles, **loss), "opd-1": _cfg(work, "opd-1", 1, cycles, **loss)}
    weighted = _cfg(work, "opd-1-plain", 1, cycles, **loss)
    cfgs["opd-1-plain"] = dataclasses.replace(weighted, train={**weighted.train, "opd_is_cap": None})
    out["opd_is_cap"] = cfgs["opd-1"].train_settings.opd_is_cap
    out["own_samples_kl"] = _learn(out, work, cfgs, cycles)
    runs = out["runs"]
    for name in ("opd-1", "opd-1-plain"):
        out[f"{name} kl_ratio"] = runs[name]["final_heldout_kl"] / runs["opd-0"]["final_heldout_kl"]
        out[f"{name} own_kl_ratio"] = out["own_samples_kl"][name] / out["own_samples_kl"]["opd-0"]
    return out


def seeds(work: Path, cycles: int = QUALITY_CYCLES, seeds: tuple[int, ...] = SEEDS) -> dict:
    """The quality part under each of `seeds`: strict and staleness 1, held-out and own-samples KL (module doc)."""
    from pipeline.onpolicy.config import OnPolicyConfig

    out: dict = {"cycles": cycles, "steps": cycles * 2, "seeds": list(seeds), "runs": {},
                 "quality_seed": OnPolicyConfig.seed}  # the quality part's (the default)
    cfgs = {f"s{seed}-{n}": _cfg(work, f"s{seed}-{n}", n, cycles, seed=seed) for seed in seeds for n in (0, 1)}
    out["own_samples_kl"] = _learn(out, work, cfgs, cycles)
    return out


def lr(work: Path, cycles: int = QUALITY_CYCLES, rate: tuple[float, float] = LR) -> dict:
    """The seeds' strict and staleness-1 runs at `rate` (train.lr, train.min_lr; module doc)."""
    from pipeline.onpolicy.config import OnPolicyConfig

    seeds = (OnPolicyConfig.seed, *SEEDS)
    out: dict = {"cycles": cycles, "steps": cycles * 2, "seeds": list(seeds), "lr": list(rate), "runs": {}}
    step = {"train.lr": rate[0], "train.min_lr": rate[1]}
    cfgs = {f"lr-s{seed}-{n}": _cfg(work, f"lr-s{seed}-{n}", n, cycles, seed=seed, **step) for seed in seeds
            for n in (0, 1)}
    out["own_samples_kl"] = _learn(out, work, cfgs, cycles)
    return out


def _default_runs(q: dict, sd: dict) -> tuple[dict, dict]:
    """The default lr's runs under every seed measured (the quality part's and the seeds part's): {seed: (strict,
    staleness 1)} runs and own-samples KLs."""
    seeds = [sd["quality_seed"], *sd["seeds"]]
    runs = {seeds[0]: (q["runs"]["real-0"], q["runs"]["real-1"]),
            **{s: (sd["runs"][f"s{s}-0"], sd["runs"][f"s{s}-1"]) for s in sd["seeds"]}}
    own = {seeds[0]: (q["own_samples_kl"]["real-0"], q["own_samples_kl"]["real-1"]),
           **{s: (sd["own_samples_kl"][f"s{s}-0"], sd["own_samples_kl"][f"s{s}-1"]) for s in sd["seeds"]}}
    return runs, own


def _lr_rows(lp: dict) -> list[str]:
    """The lr part's rows: the ratios at its lower lr over its seeds (the lever: a smaller policy change per cycle)."""
    runs = {s: (lp["runs"][f"lr-s{s}-0"], lp["runs"][f"lr-s{s}-1"]) for s in lp["seeds"]}
    own = {s: (lp["own_samples_kl"][f"lr-s{s}-0"], lp["own_samples_kl"][f"lr-s{s}-1"]) for s in lp["seeds"]}
    return _ratio_rows(runs, own, f", lr {_e(lp['lr'][0])}", "report (a third of the default lr)")


def _lr_note(lp: dict, default: tuple[dict, dict]) -> str:
    """Whether the lower lr still learns: each seed's strict run there against the same seed's at the default lr."""
    runs, own = default
    seeds = [s for s in lp["seeds"] if s in runs]
    held = [lp["runs"][f"lr-s{s}-0"]["final_heldout_kl"] / runs[s][0]["final_heldout_kl"] for s in seeds]
    mine = [lp["own_samples_kl"][f"lr-s{s}-0"] / own[s][0] for s in seeds]
    return (f"The lr rows: train.lr {_e(lp['lr'][0])} (min_lr {_e(lp['lr'][1])}) in place of 3e-4 (3e-5), the same cycles "
            f"and seeds. Their strict runs against the default lr's strict runs, seeds {', '.join(map(str, seeds))}: "
            f"held-out KL {', '.join(f'{r:.3f}' for r in held)}×, own-samples KL "
            f"{', '.join(f'{r:.3f}' for r in mine)}× (below 1: the lower lr ends nearer the teacher).")


def _e(x: float) -> str:
    """1e-4, not 0.0001."""
    mantissa, exp = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exp)}"


def _ratio_rows(runs: dict, own: dict, label: str, goal: str) -> list[str]:
    """The held-out and own-samples rows over seeds, {seed: (strict, staleness 1)} runs and own-samples KLs: their
    geometric mean, each seed's, and the KLs behind them, so the 5 % goal is read against the seed's own spread."""
    seeds = list(runs)
    rows = []
    for what, kls in (("held-out", {s: (a["final_heldout_kl"], b["final_heldout_kl"]) for s, (a, b) in runs.items()}),
                      ("own-samples", own)):
        ratios = [b / a for a, b in kls.values()]
        gmean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        rows.append(f"| {what} KL at staleness 1 vs 0, real engines{label}, {len(seeds)} seeds | **{gmean:.3f}×** "
                    "(geometric "
                    f"mean; seeds {', '.join(map(str, seeds))}: {', '.join(f'{r:.3f}' for r in ratios)}×) | "
                    + " / ".join(f"{a:.4f}" for a, _ in kls.values()) + " | "
                    + " / ".join(f"{b:.4f}" for _, b in kls.values()) + " | "
                    + (f"{goal} |" if what == "held-out" else "report |"))
    return rows


def _upgrade(kept: dict) -> dict:
    """Stored results from before the parts (one flat dict: real-0 recorded the schedule and gave the strict KL, at
    the schedule's cycles) as the two parts, so a part can be kept from them."""
    if "runs" not in kept:
        return kept
    runs = dict(kept["runs"])
    measured = runs.pop("measured", None)
    flat = {k: v for k, v in kept.items() if k not in ("runs", "kl_ratio")}
    sched = {**flat, "runs": {k: v for k, v in runs.items() if k != "real-1"}, "measured": measured}
    qual = {"cycles": kept["cycles"], "steps": kept["steps"], "runs": {k: runs[k] for k in ("real-0", "real-1")},
            "kl_ratio": kept["kl_ratio"], "measured": measured}
    return {"schedule": sched, "quality": qual}


def run(work: Path, cycles: int = CYCLES, *, parts=PARTS, kept: dict | None = None) -> dict:
    """The section's parts; one not in `parts` is taken from `kept` (the section's stored raw results, stamped with
    the run that measured them: `report.stored_raw`), so one part can be re-measured alone."""
    from benchmarks.report import measure_parts

    measure = {"schedule": lambda: schedule(work / "schedule", cycles), "quality": lambda: quality(work / "quality"),
               "opd": lambda: opd(work / "opd"), "seeds": lambda: seeds(work / "seeds"), "lr": lambda: lr(work / "lr")}
    return measure_parts("overlap", "--overlap-parts", measure, parts, _upgrade(kept or {}))


def _busy(run: dict) -> str:
    return " / ".join(f"{run['busy_s'][r]:.1f}" for r in ("sampler", "teacher", "trainer")) + " s"


def _opd_rows(o: dict) -> list[str]:
    """The OPD part's rows: with its importance weights (the row the issue names), and the unweighted control."""
    runs, own = o["runs"], o["own_samples_kl"]
    k0 = runs["opd-0"]
    rows = []
    for name, what in (("opd-1", f"importance weights, cap {o['opd_is_cap']:g}"),
                       ("opd-1-plain", "control: no importance weights")):
        k = runs[name]
        stale = [x["max"] for x in k["staleness"] if x]
        label = "opd" if name == "opd-1" else "opd without importance weights"
        rows += [
            f"| held-out KL at staleness 1 vs 0, real engines, {label} | **{o[f'{name} kl_ratio']:.3f}×** | "
            f"{k0['final_heldout_kl']:.4f} | {k['final_heldout_kl']:.4f} ({what}; staleness max per cycle {stale}) | "
            + ("≤ 1.05× |" if name == "opd-1" else "report |"),
            f"| own-samples KL at staleness 1 vs 0, real engines, {label} | **{o[f'{name} own_kl_ratio']:.3f}×** | "
            f"{own['opd-0']:.4f} | {own[name]:.4f} | report |"]
    return rows


def markdown(res: dict) -> str:
    r, q, o, sd, lp = res["schedule"], res["quality"], res["opd"], res.get("seeds"), res.get("lr")
    runs = r["runs"]
    r0, r1, rec = runs["replay-0"], runs["replay-1"], runs["real-0"]
    k0, k1 = q["runs"]["real-0"], q["runs"]["real-1"]

    def idle(run: dict) -> str:
        return " / ".join(f"{run['idle_fraction'][x]:.2f}" for x in ROLES)

    stale = [s["max"] for s in k1["staleness"] if s]
    curve = [f"| {i * 2} | {a:.4f} | {b:.4f} |" for i, (a, b) in enumerate(zip(k0["heldout_kl"], k1["heldout_kl"],
                                                                             strict=True))]
    own = q.get("own_samples_kl")
    untrained = k0["heldout_kl"][0]
    above = [n for n, k in (("strict", k0), ("staleness 1", k1)) if k["final_heldout_kl"] > untrained]
    kept = [f"The {name} rows are kept from an earlier run: measured by {part['measured']}." for part, name in
            ((r, "schedule"), (q, "quality"), (o, "opd"), (sd or {}, "seeds"), (lp or {}, "lr"))
            if part.get("measured")]
    default = _default_runs(q, sd) if sd else None
    return "\n".join([
        f"The on-policy bench's student, teacher and settings, local executor. Schedule rows (1-2): **{r['cycles']} "
        "cycles**, the sampler and the teacher **replayed** (their outputs recorded from a strict real-engine run, "
        f"handed back paced at {r['pace_tok_s']:.0f} tokens/s, sleeping), the trainer trains and evaluates for real "
        f"with {r['trainer_threads']} torch thread(s) in both schedules; the pace makes generate + score "
        f"({r0['busy_s']['sampler'] + r0['busy_s']['teacher']:.0f} s) about equal to the trainer's export + train + "
        f"eval ({r0['busy_s']['trainer']:.0f} s) in the strict replayed run. Wall time of the cycles: first task "
        "dispatched to last task ended (state.json); the command's wall time (role-process start-up, held-out set) "
        f"beside it. Quality rows: **{q['cycles']} cycles** ({q['steps']} steps) with real tiny vLLM engines in both "
        "runs.",
        "",
        "| row | result | strict (max_staleness=0) | overlapped (max_staleness=1) | goal |",
        "|---|---|---|---|---|",
        f"| overlapped vs strict on-policy wall time, replayed engines | **{r['wall_ratio']:.2f}×** | "
        f"{r0['cycles_wall_s']} s (command {r0['run_wall_s']} s) | {r1['cycles_wall_s']} s (command "
        f"{r1['run_wall_s']} s; {r['run_wall_ratio']:.2f}×) | ≤ 0.60× (limit max/sum = {r['limit_ratio']:.2f}×; with "
        f"{r['cycles']} cycles the pipeline's fill alone bounds it at (C+1)/2C = {r['fill_bound']:.2f}×) |",
        f"| role idle fraction, strict vs overlapped | sampler / teacher / trainer: {idle(r0)} → {idle(r1)} | "
        f"busy {_busy(r0)} | busy {_busy(r1)} | report |",
        f"| held-out KL at staleness 1 vs 0, real engines | **{q['kl_ratio']:.3f}×** | {k0['final_heldout_kl']:.4f} | "
        f"{k1['final_heldout_kl']:.4f} (staleness max per cycle {stale}) | ≤ 1.05× |",
        *([f"| own-samples KL at staleness 1 vs 0, real engines | **{q['own_kl_ratio']:.3f}×** | {own['real-0']:.4f} | "
           f"{own['real-1']:.4f} | report (each final student judged on its own samples of the held-out prompts) |"]
          if own else []),
        *_opd_rows(o),
        *(_ratio_rows(*default, "", "≤ 1.05× (the single-seed row's goal, on the mean)") if default else []),
        *(_lr_rows(lp) if lp else []),
        "",
        "| optimizer step | held-out KL, strict | held-out KL, staleness 1 | opd strict | opd staleness 1 | opd staleness "
        "1, no weights |",
        "|---|---|---|---|---|---|",
        *[f"{row} {a:.4f} | {b:.4f} | {c:.4f} |" for row, a, b, c in zip(
            curve, *(o["runs"][n]["heldout_kl"] for n in ("opd-0", "opd-1", "opd-1-plain")), strict=True)],
        "",
        *([f"The held-out set is the untrained student's samples ({untrained:.4f} before training): "
           f"{' and '.join(above)} end{'s' if len(above) == 1 else ''} above it, as the on-policy bench's on-policy "
           "student does, since training on its own, moving samples does not aim at the initial student's."
           + (" The own-samples row judges each student where on-policy training aims." if own else ""), ""]
          if above else []),
        f"Load average (1 min) at each run's start → end: schedule real-0 {rec['load_start']} → {rec['load_end']}, "
        f"replay-0 {r0['load_start']} → {r0['load_end']}, replay-1 {r1['load_start']} → {r1['load_end']}; quality "
        f"real-0 {k0['load_start']} → {k0['load_end']}, real-1 {k1['load_start']} → {k1['load_end']}; opd "
        + ", ".join(f"{n} {o['runs'][n]['load_start']} → {o['runs'][n]['load_end']}" for n in o["runs"])
        + "".join(f"; {part} {n} {k['load_start']} → {k['load_end']}" for part, x in (("seeds", sd), ("lr", lp))
                  for n, k in (x or {}).get("runs", {}).items())
        + " (2 cores shared: the trainer's speed varies with it; the KL rows do not depend on it). The opd rows: "
        f"**loss=opd**, the same cycles and engines; {o['opd_is_cap']:g} is train.opd_is_cap's default. Not measured "
        "here: the kills row (overlapkills).",
        *(["", _lr_note(lp, default)] if lp and default else []),
        *(["", *kept] if kept else []),
    ])


if __name__ == "__main__":
    import sys
    import tempfile

    res = run(Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="overlap-bench-")))  # both parts
    print(json.dumps(res, indent=1, default=str))
    print(markdown(res))
