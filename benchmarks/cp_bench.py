"""Context parallelism: peak memory per rank and step time, CP=2 vs CP=1, one 16k-token sequence (issue #33).

    python -m benchmarks.run --only cp

The same random Qwen2-shaped student (fp32, GQA, Adam, the fused loss, packed rows; CPU, gloo) trains one sequence
of 16,384 tokens per step from a synthetic cache (benchmarks/gpu_bench.py's: random tokens, a random top-64 teacher),
as one process (CP=1) and as two under torchrun (CP=2 x DP=1: each rank holds 8,192 of the tokens). Both run the
trainer's own `train_step` (`setup_model_and_optimizer`, the loader, Megatron's schedule), one process after the other.

What is measured, per rank process, from /proc/self/status: the first step's peak resident set above the resident
set just before it (VmHWM reset through /proc/self/clear_refs, then VmHWM - VmRSS: the step's activations, gathered
K/V, gradient temporaries and the optimizer state it creates, not the interpreter, weights or grad buffers, which do
not change with CP), with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_) so the RSS follows live memory
rather than the allocator's history; the larger of the two CP ranks is compared against the CP=1 process. VmHWM itself (whole
process) is reported beside it. tracemalloc would not see torch's allocations. Step time: the median of the steps
after the first; under CP=2 the two ranks share the machine's cores (2 on the reference machine), so the ratio there
says what the gathers cost beside the halved work, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_bench import build_cache, build_student

ROOT = Path(__file__).resolve().parents[1]
# ~1M parameters, 4 layers: a model small enough to run 16k tokens on a laptop's cores in seconds, whose memory at
# that length is its activations (what CP splits); GQA as in the students CP is for.
SHAPE = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=2048, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)
TOKENS = 16384


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def worker(student: str, cache: str, out: str, cp: int, steps: int) -> None:
    """One rank: build the student, then the first step under a reset peak-RSS mark, then `steps - 1` timed ones."""
    import torch
    import torch.distributed as dist

    from pipeline.train.config import TrainConfig
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.metrics import KD_SUM
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed
    from pipeline.train.setup import setup_model_and_optimizer
    from pipeline.train.step import train_step

    cfg = TrainConfig(student=student, cache=[cache], backend="megatron", micro_batch_size=1, global_batch_size=1,
                      seq_length=TOKENS, context_parallel_size=cp, train_steps=steps + 1, warmup_steps=0,
                      progress=False)
    init_distributed(tp=1, pp=1, seed=cfg.seed, cp=cp)
    model, ddp, optimizer, scheduler = setup_model_and_optimizer(cfg, Path(student))
    batches = ScoredLoader(cfg.cache, micro_batch_size=1, seq_length=TOKENS, seed=cfg.seed).iter_from(0, prefetch=0)
    micro = [next(batches) for _ in range(steps)]
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    times, losses = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        _, reports, _, _ = train_step(cfg, ddp, optimizer, scheduler, [micro[i]], model.hf_vocab_size)
        times.append(time.perf_counter() - t0)
        losses.append(float(reports[0][KD_SUM]))
        if i == 0:
            peak = _status("VmHWM")
    row = torch.tensor([peak - before, peak, before, *times, *losses], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps([{
            "step_peak_bytes": int(r[0]), "vmhwm_bytes": int(r[1]), "rss_before_bytes": int(r[2]),
            "step_seconds": r[3:3 + steps].tolist(), "kd_sums": r[3 + steps:].tolist()} for r in rows]))
    destroy_distributed()


def _launch(student: Path, cache: Path, out: Path, cp: int, steps: int) -> list[dict]:
    # glibc keeps freed heap memory resident and moves its mmap threshold up as big blocks are freed, so the RSS
    # would depend on the allocation history; a fixed 64 KiB threshold gives every tensor its own mapping, returned
    # on free: the peak RSS is then the peak of live memory.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cp)),
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    worker_args = ["-m", "benchmarks.cp_bench", "--worker", str(student), str(cache), str(out), str(cp), str(steps)]
    launcher = [] if cp == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cp)]
    subprocess.run([sys.executable, *launcher, *worker_args], check=True, env=env, cwd=ROOT, timeout=1800,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run(work: Path | None = None, steps: int = 3) -> dict:
    work = Path(work or tempfile.mkdtemp(prefix="cp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    student = build_student(work / "student", SHAPE)
    cache = build_cache(work / "cache", student, tokens=TOKENS, rows=steps, vocab=SHAPE["vocab_size"])
    res: dict = {"shape": SHAPE, "tokens": TOKENS, "steps": steps, "load_before": os.getloadavg()[0]}
    for cp in (1, 2):
        res[f"cp{cp}"] = _launch(student, cache, work / f"cp{cp}.json", cp, steps)
    res["load_after"] = os.getloadavg()[0]
    from safetensors.torch import load_file

    res["params"] = sum(t.numel() for t in load_file(student / "model.safetensors").values())
    return res


def _summary(ranks: list[dict]) -> tuple[int, int, float]:
    """(largest step peak over the ranks, largest VmHWM, the slowest rank's median step time after the first)."""
    return (max(r["step_peak_bytes"] for r in ranks), max(r["vmhwm_bytes"] for r in ranks),
            max(statistics.median(r["step_seconds"][1:]) for r in ranks))


def markdown(r: dict) -> str:
    mib = 1 << 20
    (p1, h1, t1), (p2, h2, t2) = _summary(r["cp1"]), _summary(r["cp2"])
    kd1 = r["cp1"][0]["kd_sums"][0]
    kd2 = sum(x["kd_sums"][0] for x in r["cp2"])
    return "\n".join([
        f"Student: a random Qwen2-shaped model ({r['params'] / 1e6:.1f}M parameters, {r['shape']['num_hidden_layers']} "
        f"layers, hidden {r['shape']['hidden_size']}, {r['shape']['num_attention_heads']} heads over "
        f"{r['shape']['num_key_value_heads']} KV heads), fp32, Adam, fused loss; one {r['tokens']:,}-token sequence a "
        f"step; CP=1 as one process, CP=2 as two under torchrun (gloo), one after the other; {r['steps']} steps each. "
        f"Load average {r['load_before']:.1f} before, {r['load_after']:.1f} after. Memory: the first step's peak RSS "
        "above the RSS before it (/proc VmHWM - VmRSS, per rank process, glibc's mmap threshold fixed at 64 KiB so "
        "that freed tensors leave the RSS; the larger CP rank), beside the whole process's VmHWM.",
        "",
        "| measure | value | goal |",
        "|---|---|---|",
        f"| cp=2 vs cp=1 peak memory per rank at 16k tokens | **{p2 / p1:.3f}×** ({p2 / mib:.0f} MiB vs "
        f"{p1 / mib:.0f} MiB a step above the resident set; whole process VmHWM {h2 / mib:.0f} vs {h1 / mib:.0f} MiB, "
        f"{h2 / h1:.2f}×); step time {t2 / t1:.2f}× ({t2:.2f} s vs {t1:.2f} s, the 2 ranks sharing "
        f"{os.cpu_count()} cores) | ≤ 0.65× |",
        f"| first-step KD loss sum, cp=2 (both ranks) vs cp=1 | {kd2:.4f} vs {kd1:.4f} | equal up to rounding |",
    ])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=5, metavar=("STUDENT", "CACHE", "OUT", "CP", "STEPS"))
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker[:3], int(a.worker[3]), int(a.worker[4]))
    else:
        out = run()
        print(json.dumps(out, indent=1))
        print(markdown(out))
