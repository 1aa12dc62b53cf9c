"""Pipeline parallelism: peak memory per rank, PP=2 vs PP=1, and interleaved 1F1B's step time, PP=2 x VPP=2 vs PP=2
(issue 48).

    python -m benchmarks.run --only pp

The same random Qwen2-shaped student (8 layers, fp32, Adam, the fused loss, packed rows; CPU, gloo), whose layers
hold nearly all its parameters (a 512-token vocabulary: the embedding and output layer are 2 % of them), trains the
same global batch (8 micro-batches of one 128-token row a step) from a synthetic cache (benchmarks/gpu_bench.py's) three times, one
after the other, through the trainer's own `train_step` (`setup_model_and_optimizer`, the loader, Megatron-Core's
schedules): PP=1 as one process; PP=2 under torchrun (1F1B, 4 layers a stage); PP=2 x VPP=2 (interleaved 1F1B, two
model chunks of 2 layers a stage).

Memory, per rank process, from /proc/self/status: the peak resident set (VmHWM) over the model's build, its first
step and its optimizer state, above the resident set just before the build (VmHWM reset through
/proc/self/clear_refs): weights, gradient buffers, Adam's moments, the activations in flight; not the interpreter and
its imports, which do not change with PP. glibc's mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_) so the RSS follows
live memory rather than the allocator's history. The larger of the two PP ranks is compared against the PP=1 process.
Step time: the fastest of the steps after the first (the least disturbed by other work on a shared machine: the
load rose from 7 to 18 during one run, and medians moved 2x with it), the slower rank. Under PP=2 the two ranks share the machine's
cores (2 on the reference machine), so a rank waiting in the bubble hands its core to the other: the step-time ratio
says what interleaving costs (twice the stage-to-stage messages) beside the bubble it removes, not a GPU's speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_bench import build_cache, build_student

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-6)
TOKENS = 128  # one row a micro-batch: activations small beside the layers' weights and optimizer state
MICRO = 8  # micro-batches a step: more than the 2 stages (and a multiple of them, as interleaving needs)
RUNS = {"pp1": (1, 1), "pp2": (2, 1), "pp2_vpp2": (2, 2)}  # name -> (P, V)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def worker(student: str, cache: str, out: str, pp: int, vpp: int, steps: int) -> None:
    """One rank: reset the peak-RSS mark, build the student and its optimizer, run `steps` steps (the first one makes
    Adam's state); the peak above the mark after the first step, and each step's time."""
    import torch
    import torch.distributed as dist

    from pipeline.train.config import TrainConfig
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed
    from pipeline.train.setup import setup_model_and_optimizer
    from pipeline.train.step import train_step

    cfg = TrainConfig(student=student, cache=[cache], backend="megatron", micro_batch_size=1, global_batch_size=MICRO,
                      seq_length=TOKENS, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                      train_steps=steps + 1, warmup_steps=0, progress=False)
    init_distributed(tp=1, pp=pp, seed=cfg.seed, vpp=vpp)
    batches = ScoredLoader(cfg.cache, micro_batch_size=1, seq_length=TOKENS, seed=cfg.seed).iter_from(0, prefetch=0)
    micro = [[next(batches) for _ in range(MICRO)] for _ in range(steps)]
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    model, ddp, optimizer, scheduler = setup_model_and_optimizer(cfg, Path(student))
    params = sum(p.numel() for p in model.parameters())
    times = []
    for i in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(cfg, ddp, optimizer, scheduler, micro[i], model.hf_vocab_size)
        times.append(time.perf_counter() - t0)
        if i == 0:
            peak = _status("VmHWM")
    row = torch.tensor([peak - before, peak, before, params, *times], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps([{
            "peak_above_bytes": int(r[0]), "vmhwm_bytes": int(r[1]), "rss_before_bytes": int(r[2]),
            "params": int(r[3]), "step_seconds": r[4:].tolist()} for r in rows]))
    destroy_distributed()


def _launch(student: Path, cache: Path, out: Path, pp: int, vpp: int, steps: int) -> list[dict]:
    # one thread a rank process in every run: the same compute per rank whatever P (2 threads for PP=1 thrashed on a
    # loaded 2-core machine: 13-56 s steps against 2-3 s at PP=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536"}  # as cp_bench.py: freed tensors leave the RSS
    worker_args = ["-m", "benchmarks.pp_bench", "--worker", str(student), str(cache), str(out), str(pp), str(vpp),
                   str(steps)]
    launcher = [] if pp == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(pp)]
    subprocess.run([sys.executable, *launcher, *worker_args], check=True, env=env, cwd=ROOT, timeout=1800,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run(work: Path | None = None, steps: int = 4) -> dict:
    work = Path(work or tempfile.mkdtemp(prefix="pp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    student = build_student(work / "student", SHAPE)
    cache = build_cache(work / "cache", student, tokens=TOKENS, rows=MICRO * steps, vocab=SHAPE["vocab_size"])
    res: dict = {"shape": SHAPE, "tokens": TOKENS, "micro": MICRO, "steps": steps, "load_before": os.getloadavg()[0]}
    for name, (pp, vpp) in RUNS.items():
        res[name] = _launch(student, cache, work / f"{name}.json", pp, vpp, steps)
    res["load_after"] = os.getloadavg()[0]
    return res


def _summary(ranks: list[dict]) -> tuple[int, int, float]:
    """(largest peak above the pre-build RSS over the ranks, largest VmHWM, the slower rank's fastest step after the
    first)."""
    return (max(r["peak_above_bytes"] for r in ranks), max(r["vmhwm_bytes"] for r in ranks),
            max(min(r["step_seconds"][1:]) for r in ranks))


def markdown(r: dict) -> str:
    mib = 1 << 20
    (p1, h1, _), (p2, h2, t2), (_, _, tv) = (_summary(r[name]) for name in RUNS)
    m, pp, vpp = r["micro"], 2, 2
    bubble, bubble_v = (pp - 1) / m, (pp - 1) / (vpp * m)
    params = r["pp1"][0]["params"]
    per_rank = [x["params"] for x in r["pp2"]]
    return "\n".join([
        f"Student: a random Qwen2-shaped model ({params / 1e6:.1f}M parameters, {r['shape']['num_hidden_layers']} "
        f"layers, hidden {r['shape']['hidden_size']}, vocabulary {r['shape']['vocab_size']}), fp32, Adam, fused loss; "
        f"{m} micro-batches of one {r['tokens']}-token row a step; PP=1 as one process, PP=2 (1F1B; "
        f"{' and '.join(f'{p / 1e6:.2f}M' for p in per_rank)} parameters on the two stages) and PP=2 x VPP=2 "
        f"(interleaved 1F1B) as two under torchrun (gloo), one after the other; {r['steps']} steps each. Load average "
        f"{r['load_before']:.1f} before, {r['load_after']:.1f} after (the machine shared with other work). Memory: "
        "the peak RSS over the model's build and first step above the RSS before the build (/proc VmHWM - VmRSS, per "
        "rank process, glibc's mmap threshold fixed at 64 KiB so that freed tensors leave the RSS; the larger PP "
        "rank): weights, gradient buffers, Adam's state, activations in flight; beside it each process's whole VmHWM. "
        "Step time: the fastest step after the first (the least disturbed by the machine's other work), the slower "
        "rank; each run's step times are in the raw results.",
        "",
        "| measure | value | goal |",
        "|---|---|---|",
        f"| pp=2 vs pp=1 peak memory per rank | **{p2 / p1:.3f}×** ({p2 / mib:.0f} MiB vs {p1 / mib:.0f} MiB above the "
        f"resident set before the build; whole process VmHWM {h2 / mib:.0f} vs {h1 / mib:.0f} MiB, {h2 / h1:.2f}×) | "
        "≤ 0.60× |",
        f"| pp=2 vpp=2 vs pp=2 step time | **{tv / t2:.2f}×** ({tv:.2f} s vs {t2:.2f} s, {m} micro-batches, 2 ranks "
        f"sharing {os.cpu_count()} cores, one thread each); bubble expected from the schedule: (P-1)/(V·M) = {bubble_v:.3f} of a step "
        f"interleaved vs (P-1)/M = {bubble:.3f} for 1F1B | report |",
    ])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=6, metavar=("STUDENT", "CACHE", "OUT", "PP", "VPP", "STEPS"))
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker[:3], *(int(x) for x in a.worker[3:]))
    else:
        out = run()
        print(json.dumps(out, indent=1))
        print(markdown(out))
