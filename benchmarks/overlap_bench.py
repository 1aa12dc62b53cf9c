"""Overlapped on-policy cycles (issue 47): max_staleness=1 against the strict order, on the local executor.

    python -m benchmarks.run --only overlap          (four whole runs: ~15-25 min on 2 loaded CPU cores)

The on-policy bench's student, teacher and settings (benchmarks/onpolicy_bench.py: SmolLM2 6-layer student,
SmolLM2-135M-Instruct teacher, 8 prompts x n=2 per cycle, 2 steps per cycle, held-out KL every cycle), `CYCLES`
cycles, four runs in this order:

1. real-0: max_staleness=0, the real tiny vLLM engines, each engine wrapped so that what its `generate` returned is
   recorded (sampler: by prompt token ids and request seed; teacher: by token ids);
2. real-1: max_staleness=1, real engines (one process per role, each opening its own): the held-out KL row;
3. replay-0 and 4. replay-1: the same cycles with the sampler and the teacher replayed from run 1's record, paced
   at one fixed tokens/s (generated tokens for the sampler, scored positions for the teacher; the wait is a sleep,
   so the stand-ins use no CPU), while the trainer trains and evaluates for real. The pace is chosen from run 1 so
   that generate + score time = train + eval time of a cycle: the regime where overlap can halve the wall time.
   Replayed, the staleness-1 run samples what the strict run's policy sampled (its own, staler policy is not
   consulted): these two runs measure the schedule, not the learning; run 2 measures the learning.

Two cores are shared by every process here (and by other users of the machine), so the trainer's torch threads are
set to a role process's share (`cpu_count // 3`, what local.RoleProcesses gives each role) in the strict runs too:
both schedules train at the same speed. Every run has a cache of its own (a shared one would make the second run
score nothing). Wall times are read from state.json: the cycles' wall is the first task's dispatch to the last
task's end; a role's busy time is the sum of its tasks' end - start (trainer: export, train, eval).
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.onpolicy_bench import _config
from benchmarks.scorework_bench import Replay
from pipeline.onpolicy.config import STAGES
from pipeline.onpolicy.engines import Engines

CYCLES = 3  # the on-policy bench runs 6 (12 steps); four runs of 3 cycles fit the 2 shared, loaded cores in ~25 min
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


def _one(work: Path, name: str, staleness: int, cycles: int, engines, role_engines=Engines, **extra) -> dict:
    from pipeline.onpolicy.local import run_local

    cfg = _config(work, name, 1.0, cycles, 2, 0, cache=str(work / name / "cache"), max_staleness=staleness, **extra)
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


def run(work: Path, cycles: int = CYCLES) -> dict:
    import torch

    work.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    share = max(1, (os.cpu_count() or 1) // len(ROLES))
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
        idle = Engines()  # unused at max_staleness=1: each role process opens its own
        _keep(out, "real-1", _one(work, "real-1", 1, cycles, idle))
        idle.close()
    finally:
        torch.set_num_threads(threads)
    runs = out["runs"]
    out["wall_ratio"] = runs["replay-1"]["cycles_wall_s"] / runs["replay-0"]["cycles_wall_s"]
    out["run_wall_ratio"] = runs["replay-1"]["run_wall_s"] / runs["replay-0"]["run_wall_s"]
    r = runs["replay-0"]
    out["limit_ratio"] = max(r["busy_s"]["sampler"] + r["busy_s"]["teacher"], r["busy_s"]["trainer"]) / sum(
        r["busy_s"].values())
    out["fill_bound"] = (cycles + 1) / (2 * cycles)  # G + S = T: strict 2CT, overlapped (G + S) + CT at best
    out["kl_ratio"] = runs["real-1"]["final_heldout_kl"] / runs["real-0"]["final_heldout_kl"]
    return out


def _busy(run: dict) -> str:
    return " / ".join(f"{run['busy_s'][r]:.1f}" for r in ("sampler", "teacher", "trainer")) + " s"


def markdown(r: dict) -> str:
    runs = r["runs"]
    r0, r1, k0, k1 = runs["replay-0"], runs["replay-1"], runs["real-0"], runs["real-1"]

    def idle(run: dict) -> str:
        return " / ".join(f"{run['idle_fraction'][x]:.2f}" for x in ROLES)

    stale = [s["max"] for s in k1["staleness"] if s]
    curve = [f"| {i * 2} | {a:.4f} | {b:.4f} |" for i, (a, b) in enumerate(zip(k0["heldout_kl"], k1["heldout_kl"],
                                                                             strict=True))]
    return "\n".join([
        f"The on-policy bench's student, teacher and settings, **{r['cycles']} cycles** ({r['steps']} steps; the "
        "on-policy bench runs 6, shortened here so four runs fit the shared cores), local executor. Rows 1-2: the "
        "sampler and the teacher are **replayed** (their outputs recorded from the strict real-engine run, handed "
        f"back paced at {r['pace_tok_s']:.0f} tokens/s, sleeping), the trainer trains and evaluates for real with "
        f"{r['trainer_threads']} torch thread(s) in both schedules; the pace makes generate + score "
        f"({r0['busy_s']['sampler'] + r0['busy_s']['teacher']:.0f} s) about equal to the trainer's export + train + "
        f"eval ({r0['busy_s']['trainer']:.0f} s) in the strict replayed run. Row 3: real tiny vLLM engines in both "
        "runs. Wall time of the cycles: first task dispatched to last task ended (state.json); the command's "
        "wall time (role-process start-up, held-out set) beside it.",
        "",
        "| row | result | strict (max_staleness=0) | overlapped (max_staleness=1) | goal |",
        "|---|---|---|---|---|",
        f"| overlapped vs strict on-policy wall time, replayed engines | **{r['wall_ratio']:.2f}×** | "
        f"{r0['cycles_wall_s']} s (command {r0['run_wall_s']} s) | {r1['cycles_wall_s']} s (command "
        f"{r1['run_wall_s']} s; {r['run_wall_ratio']:.2f}×) | ≤ 0.60× (limit max/sum = {r['limit_ratio']:.2f}×; with {r['cycles']} cycles the pipeline's fill alone bounds it at "
        f"(C+1)/2C = {r['fill_bound']:.2f}×) |",
        f"| role idle fraction, strict vs overlapped | sampler / teacher / trainer: {idle(r0)} → {idle(r1)} | "
        f"busy {_busy(r0)} | busy {_busy(r1)} | report |",
        f"| held-out KL at staleness 1 vs 0, real engines | **{r['kl_ratio']:.3f}×** | {k0['final_heldout_kl']:.4f} | "
        f"{k1['final_heldout_kl']:.4f} (staleness max per cycle {stale}) | ≤ 1.05× |",
        "",
        "| optimizer step | held-out KL, strict | held-out KL, staleness 1 |",
        "|---|---|---|",
        *curve,
        "",
        f"Load average (1 min) at each run's start → end: real-0 {k0['load_start']} → {k0['load_end']}, real-1 "
        f"{k1['load_start']} → {k1['load_end']}, replay-0 {r0['load_start']} → {r0['load_end']}, replay-1 "
        f"{r1['load_start']} → {r1['load_end']} (2 cores shared with other users: the trainer's speed varies with "
        "it). The real-engine runs' wall times (raw results) are not a schedule measurement: there the three roles "
        "compete for the same two cores. Not measured here: the OPD row (OPD refuses max_staleness >= 1 for now), the "
        "kills row.",
    ])


if __name__ == "__main__":
    import sys
    import tempfile

    res = run(Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="overlap-bench-")))
    print(json.dumps(res, indent=1, default=str))
    print(markdown(res))
