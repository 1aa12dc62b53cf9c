"""On-policy vs off-policy GKD on the embedded default, same number of optimizer steps, held-out student samples.

    python -m benchmarks.run --only onpolicy          (two whole runs: ~30-60 min on 2 CPU cores)

The GKD paper's claim (Agarwal et al. 2024, "On-Policy Distillation of Language Models") is that training on the
student's own samples beats training on fixed data when the student is judged on what it generates. Both runs
here start from the same student (SmolLM2 6-layer) and teacher (SmolLM2-135M-Instruct), use the same optimizer,
learning rate, batch size and number of steps, and are scored on the same held-out set: samples that the *initial*
student generated for prompts neither run trains on, scored by the teacher (KL(teacher || student) per token over
the top-k + tail bins, a plain transformers forward; pipeline/evaluate.py).

- on-policy (lmbda=1): every cycle samples 8 new prompts x n=2 with the current student and trains on them;
- off-policy (lmbda=0): the same number of samples, reasoning-gym's reference answers, scored once up front.

Both read/write one teacher cache directory for the held-out rows, so the second run scores nothing for them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.evaluate import heldout_kl
from pipeline.generate.prompts import load_prompts
from pipeline.onpolicy.state import rollout_keys
from pipeline.store import TeacherCache

PROMPTS = "reasoning-gym:basic_arithmetic?size=128&seed=0"
DATASET = "reasoning-gym:basic_arithmetic?size={size}&seed=1"
HELDOUT = "reasoning-gym:basic_arithmetic?size=24&seed=2"


def _config(work: Path, name: str, lmbda: float, cycles: int, spg: int, samples: int, **extra):
    from pipeline.onpolicy.config import load

    values = {
        "out": str(work / name), "cache": str(work / "cache"), "num_cycles": cycles, "steps_per_generation": spg,
        "lmbda": lmbda, "prompts": PROMPTS, "prompts_per_cycle": 8, "generate.n": 2, "generate.max_tokens": 64,
        "heldout_prompts": HELDOUT, "heldout_n": 2, "train.micro_batch_size": 4, "train.global_batch_size": 8,
        "train.lr": 3.0e-4, "train.min_lr": 3.0e-5, "train.warmup_steps": 1, "progress": False,
    }
    if lmbda < 1:
        values |= {"offpolicy_cache": str(work / "offpolicy-cache"), "offpolicy_dataset": DATASET.format(size=samples)}
    return load(None, values | extra)


def run(work: Path, cycles: int = 6, spg: int = 2) -> dict:
    from pipeline.onpolicy.engines import Engines
    from pipeline.onpolicy.local import run_local as onpolicy

    work.mkdir(parents=True, exist_ok=True)
    samples = cycles * 8 * 2  # on-policy samples over the run = off-policy rows, each seen once by both
    engines = Engines()  # the teacher engine and the sampler stay open across both runs
    out: dict = {"cycles": cycles, "steps_per_generation": spg, "steps": cycles * spg, "samples": samples,
                 "prompts": PROMPTS, "offpolicy_dataset": DATASET.format(size=samples), "heldout": HELDOUT}
    cfgs = {}
    try:
        for name, lmbda in (("offpolicy", 0.0), ("onpolicy", 1.0)):
            t0 = time.perf_counter()
            cfgs[name] = _config(work, name, lmbda, cycles, spg, samples)
            lines = onpolicy(cfgs[name], engines)
            wall = time.perf_counter() - t0
            state = json.loads((work / name / "state.json").read_text())
            stage_s: dict[str, float] = {}
            for info in state["cycles"].values():
                for stage, s in info["seconds"].items():
                    stage_s[stage] = round(stage_s.get(stage, 0.0) + s, 1)
            out[name] = {
                "lmbda": lmbda, "wall_s": round(wall, 1), "stage_seconds": stage_s,
                "curve": [{"step": m["step"], "heldout_kl": m["heldout_kl"]} for m in lines if "heldout_kl" in m],
                "heldout_tokens": next((m["heldout_tokens"] for m in lines if "heldout_tokens" in m), None),
                "train_loss": [m.get("loss") for m in lines if m["cycle"] >= 0],
                "generate_tok_s": [m.get("generate_tok_s") for m in lines if m.get("generate_tok_s")],
                "score_tok_s": [m.get("score_tok_s") for m in lines if m.get("score_tok_s")],
            }
        out["final_samples"] = _final_samples_kl(cfgs, engines)
    finally:
        engines.close()
    return out


def _final_samples_kl(cfgs: dict, engines, cross: bool = True) -> dict:
    """Each final student samples the held-out prompts (same seed), the teacher scores both sets (into each run's
    cache), and both students are evaluated on both: {"<student> on <whose samples>": KL}; `cross=False`: each on
    its own only. The on-policy claim is about the diagonal."""
    from pipeline.onpolicy.stages import Workspace, sample, score_into

    runs = {name: Workspace.open(cfg) for name, cfg in cfgs.items()}
    prompts = load_prompts(HELDOUT)
    keys, weights = {}, {}
    for name, ws in runs.items():
        weights[name] = ws.weights(ws.latest_step())
        sample(ws, engines, "final-heldout", prompts, weights[name], ws.latest_step(), ws.cfg.seed + 2_000_003,
               ws.cfg.heldout_n)
        score_into(ws, ws.rollouts("final-heldout"), ws.cfg.cache, engines.scorer(ws.cfg, ws.teacher))
        keys[name] = rollout_keys(ws.rollouts("final-heldout"), TeacherCache.open(ws.cfg.cache))
    return {f"{student} on {samples}": heldout_kl(weights[student], cfgs[samples].cache, keys[samples])["heldout_kl"]
            for student in runs for samples in runs if cross or student == samples}


def markdown(r: dict) -> str:
    on, off, fs = r["onpolicy"], r["offpolicy"], r["final_samples"]
    kl0 = on["curve"][0]["heldout_kl"]
    on_end, off_end = on["curve"][-1]["heldout_kl"], off["curve"][-1]["heldout_kl"]
    rows = [f"| {a['step']} | {a['heldout_kl']:.4f} | {b['heldout_kl']:.4f} |"
            for a, b in zip(on["curve"], off["curve"], strict=True)]
    stages = sorted(set(on["stage_seconds"]) | set(off["stage_seconds"]))
    return "\n".join([
        f"Same student, teacher, optimizer (lr 3e-4, 8 samples per step) and {r['steps']} steps "
        f"({r['cycles']} cycles of {r['steps_per_generation']}); held-out: samples of the initial student on "
        f"`{r['heldout']}` (n=2, {on['heldout_tokens']} scored tokens), KL(teacher‖student) per token.",
        "",
        "| optimizer step | on-policy (lmbda=1) | off-policy (lmbda=0, reference answers) |",
        "|---|---|---|",
        *rows,
        "",
        f"Held-out KL {kl0:.3f} → on-policy **{on_end:.3f}** ({_change(on_end, kl0)}), off-policy "
        f"**{off_end:.3f}** ({_change(off_end, kl0)}): on-policy ends at **{on_end / off_end:.2f}×** the off-policy KL.",
        "",
        "| wall time per stage, seconds (whole run) | " + " | ".join(stages) + " | run total |",
        "|---|" + "---|" * (len(stages) + 1),
        "| on-policy | " + " | ".join(str(on["stage_seconds"].get(s, 0)) for s in stages) + f" | {on['wall_s']} |",
        "| off-policy | " + " | ".join(str(off["stage_seconds"].get(s, 0)) for s in stages) + f" | {off['wall_s']} |",
        "",
        "The off-policy run's total includes importing and scoring its reference answers once; both include the "
        "held-out set (generated and scored by the first run; the second finds it in the cache).",
        "",
        "The held-out set above is what the *initial* student generates. The GKD claim is about what the *trained* "
        "student generates: each final student samples the same held-out prompts (same seed), the teacher scores "
        "both sets, and each student is evaluated on both:",
        "",
        "| KL(teacher‖student) per token | on the on-policy student's samples | on the off-policy student's samples |",
        "|---|---|---|",
        *(f"| {who} student | {fs[f'{who} on onpolicy']:.4f} | {fs[f'{who} on offpolicy']:.4f} |"
          for who in ("onpolicy", "offpolicy")),
        "",
        f"On its own samples the on-policy student's KL is **{fs['onpolicy on onpolicy'] / fs['offpolicy on offpolicy']:.2f}×** "
        "the off-policy student's on its own samples (below 1 would mean on-policy wins where the GKD claim says it "
        "should).",
    ])


def _change(new: float, old: float) -> str:
    pct = 100 * (1 - new / old)
    return f"{abs(pct):.0f}% {'lower' if pct >= 0 else 'higher'}"


OPD_RUNS = {  # name -> the run's own settings; everything else as in _config
    "tail-k64": {"train.loss": "gkd", "score.topk": 64},
    "opd-k0": {"train.loss": "opd", "score.topk": 0, "heldout_prompts": None},  # k=0 rows hold no distribution to score a KL on
}


def run_opd(work: Path, cycles: int = 6, spg: int = 2) -> dict:
    """On-policy (lmbda=1) with each loss at the same steps: GKD's tail loss on k=64 rows against OPD (the sampled
    token's teacher logprob as a reward, k=0 rows). Each final student samples the held-out prompts (same seed);
    the teacher scores both sample sets at k=64 into one evaluation cache; each student is judged on its own
    samples (and on the other's), KL(teacher || student) per token over the top-64 + tail bins."""
    from dataclasses import replace

    from pipeline.onpolicy.engines import Engines
    from pipeline.onpolicy.local import run_local as onpolicy
    from pipeline.onpolicy.stages import Workspace, sample, score_into

    work.mkdir(parents=True, exist_ok=True)
    engines = Engines()
    out: dict = {"cycles": cycles, "steps_per_generation": spg, "steps": cycles * spg, "prompts": PROMPTS,
                 "heldout": HELDOUT, "runs": {}}
    cfgs = {}
    try:
        for name, own in OPD_RUNS.items():
            cfgs[name] = _config(work, name, 1.0, cycles, spg, 0, cache=str(work / f"cache-{name}"), **own)
            t0 = time.perf_counter()
            lines = onpolicy(cfgs[name], engines)
            stats = TeacherCache.open(cfgs[name].cache).stats()
            out["runs"][name] = {**own, "wall_s": round(time.perf_counter() - t0, 1),
                                 "bytes_per_token": stats["bytes_per_scored_token"],
                                 "scored_tokens": stats["scored_tokens"],
                                 "train_loss": [m.get("loss") for m in lines if m["cycle"] >= 0]}
        # the evaluation: both final students' samples, scored at k=64 (through the tail run's own score settings)
        evaluator = Workspace.open(replace(cfgs["tail-k64"], cache=str(work / "eval-cache")))
        ev_cache, ev_llm = evaluator.cfg.cache, engines.scorer(evaluator.cfg, evaluator.teacher)
        prompts = load_prompts(HELDOUT)
        weights, keys = {}, {}
        for name, cfg in cfgs.items():
            ws = Workspace.open(cfg)
            weights[name] = ws.weights(ws.latest_step())
            sample(ws, engines, "final-heldout", prompts, weights[name], ws.latest_step(), cfg.seed + 2_000_003,
                   cfg.heldout_n)
            score_into(evaluator, ws.rollouts("final-heldout"), ev_cache, ev_llm)
            keys[name] = rollout_keys(ws.rollouts("final-heldout"), TeacherCache.open(ev_cache))
        out["final_samples"] = {f"{s} on {d}": heldout_kl(weights[s], ev_cache, keys[d])["heldout_kl"]
                                for s in cfgs for d in cfgs}
        out["initial_on"] = {d: heldout_kl(Workspace.open(cfgs[d]).student, ev_cache, keys[d])["heldout_kl"]
                             for d in cfgs}
    finally:
        engines.close()
    fs = out["final_samples"]
    out["kl_ratio"] = fs["opd-k0 on opd-k0"] / fs["tail-k64 on tail-k64"]
    return out


def markdown_opd(r: dict) -> str:
    fs, runs = r["final_samples"], r["runs"]
    tail, opd = runs["tail-k64"], runs["opd-k0"]
    wins = "OPD" if r["kl_ratio"] < 1 else "the tail loss"
    return "\n".join([
        f"On-policy (lmbda=1), same student, teacher, optimizer (lr 3e-4, 8 samples per step) and {r['steps']} steps "
        f"({r['cycles']} cycles of {r['steps_per_generation']}), each loss on its own samples. Each final student "
        f"samples `{r['heldout']}` (n=2, same seed); the teacher scores both sets at k=64; KL(teacher‖student) per "
        "token over the top-64 + tail bins.",
        "",
        "| row | result | tail k=64 student | OPD k=0 student | note |",
        "|---|---|---|---|---|",
        f"| on-policy OPD k=0 vs tail k=64 KL | **{r['kl_ratio']:.2f}×** | {fs['tail-k64 on tail-k64']:.4f} | "
        f"{fs['opd-k0 on opd-k0']:.4f} | each on its own samples; below 1: OPD wins |",
        f"| on the other student's samples | - | {fs['tail-k64 on opd-k0']:.4f} | {fs['opd-k0 on tail-k64']:.4f} | "
        "- |",
        f"| initial student on these samples | - | {r['initial_on']['tail-k64']:.4f} | "
        f"{r['initial_on']['opd-k0']:.4f} | before training |",
        f"| training cache bytes/token | {opd['bytes_per_token'] / tail['bytes_per_token']:.3f}× | "
        f"{tail['bytes_per_token']:.1f} | {opd['bytes_per_token']:.1f} | OPD over tail |",
        f"| run wall time, s | {opd['wall_s'] / tail['wall_s']:.2f}× | {tail['wall_s']} | {opd['wall_s']} | "
        "generate + score + train + evals |",
        "",
        f"On its own samples {wins} reaches the lower KL at the same steps. On the other student's samples the OPD "
        f"student is at {fs['opd-k0 on tail-k64'] / fs['tail-k64 on tail-k64']:.2f}× the tail student's KL (and the "
        f"tail student at {fs['tail-k64 on opd-k0'] / fs['opd-k0 on opd-k0']:.2f}× the OPD student's on OPD samples): "
        "OPD's sampled-token reverse-KL estimate fits the teacher where the student already goes, the tail loss "
        "fits all 64 teacher entries and carries over to other samples. The OPD cache costs "
        f"{opd['bytes_per_token']:.1f} B/token against {tail['bytes_per_token']:.1f}. The wall times are not like "
        "for like: the tail run also generates and scores the held-out set once and evaluates it every cycle (k=0 rows "
        "cannot give a held-out KL).",
    ])


if __name__ == "__main__":
    import sys
    import tempfile

    res = run(Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="onpolicy-bench-")))
    print(json.dumps(res, indent=1))
    print(markdown(res))
