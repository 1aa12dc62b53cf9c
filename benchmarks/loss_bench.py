"""Loss benchmark: the fused output layer + GKD loss (``fused_tail``, ``fused_renorm``: pipeline/train/losses/fused.py)
vs the unfused ``tail`` / ``renorm`` (Megatron's full logits, then pipeline/train/losses/reference.py), an ms-swift-style renorm
and a TRL-style full-vocab JSD.

Run: ``python benchmarks/loss_bench.py --tokens 1024`` (prints a markdown table; 4096 tokens takes many minutes and,
for the TRL-style variant, more memory than a 23 GB machine has: it is skipped when it would not fit).
``--memory-tokens 16384`` adds peak-memory rows at that length (unfused variants that would not fit in this
machine's memory are measured at the largest power-of-two length that does, and say so).

Time: forward+backward in one process, variants interleaved (order rotated each round) so shared-CPU noise hits all
alike; median and min of ``repeats`` after ``warmup`` rounds. "with output layer": hidden [T, H] @ W[V, H]^T -> logits -> loss
-> backward to hidden and W (the goal of the issue); "loss only": given logits, backward to the logits.
Memory: each variant's with-output-layer step once in a fresh subprocess; reported is the peak resident-set growth
over the step, ``VmHWM − VmRSS just before it`` (peak reset via /proc/self/clear_refs) (logits, their gradient, the W/hidden gradients and every
temporary; the inputs themselves excluded). Honest on CPU because glibc serves these large blocks by mmap and
returns them on free, so RSS tracks live tensor memory.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from pipeline.train.losses.fused import fused_gkd_loss
from pipeline.train.losses.reference import gkd_loss

VARIANTS = ("fused_tail", "fused_renorm", "tail", "renorm", "swift_renorm", "trl_full_jsd")
FUSED = ("fused_tail", "fused_renorm")
REFERENCE = "swift_renorm"
# [T, V] fp32 buffers alive at each unfused variant's peak (TRL measured ≈ 11 at 256 tokens; ours: logits + their
# gradient; rounded up for safety), to skip a measurement that would not fit in memory.
_TV_BUFFERS = {"trl_full_jsd": 12, "tail": 3, "renorm": 3, "swift_renorm": 5}


def make_inputs(tokens: int, vocab: int, hidden: int, k: int, seed: int = 0) -> dict:
    """Hidden states, output weight and a synthetic teacher top-k with ~5 % tail mass (no [T, V] temporaries)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g).mul_(hidden**-0.5)  # in place: no transient second copy
    # Distinct ids per row: a random start plus a cumulative sum of positive gaps that stays below the vocab size.
    gaps = torch.randint(1, max(2, vocab // k), (tokens, k), generator=g)
    ids = (torch.randint(0, vocab, (tokens, 1), generator=g) + gaps.cumsum(-1)) % vocab
    ell = torch.log_softmax(torch.randn(tokens, k, generator=g) * 2, -1) + math.log(0.95)
    ell = ell.sort(-1, descending=True).values
    tail = torch.full((tokens,), math.log(0.05))  # what the score stage stores: the mass outside the top-k
    return {"h": h, "w": w, "ids": ids, "ell": ell, "tail": tail, "mask": torch.ones(tokens, dtype=torch.bool)}


def _jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    # TRL's generalized_jsd_loss formulation, shared by both reference variants (elementwise, not reduced).
    if beta == 0:
        return F.kl_div(student_logp, teacher_logp, reduction="none", log_target=True)
    if beta == 1:
        return F.kl_div(teacher_logp, student_logp, reduction="none", log_target=True)
    b = torch.tensor(beta, dtype=student_logp.dtype)
    mixture = torch.logsumexp(torch.stack([student_logp + torch.log(1 - b), teacher_logp + torch.log(b)]), dim=0)
    kl_t = F.kl_div(mixture, teacher_logp, reduction="none", log_target=True)
    kl_s = F.kl_div(mixture, student_logp, reduction="none", log_target=True)
    return b * kl_t + (1 - b) * kl_s


def swift_renorm_loss(logits, ids, ell, mask, beta: float, tau: float) -> torch.Tensor:
    """ms-swift style: full student log_softmax, gather at the teacher's top-k, renormalise both over the k."""
    student = torch.gather(F.log_softmax(logits / tau, dim=-1), -1, ids)
    student = student - torch.logsumexp(student, dim=-1, keepdim=True)
    teacher = F.log_softmax(ell / tau, dim=-1)
    return (_jsd(student, teacher, beta).sum(-1) * mask).sum()


def trl_full_jsd_loss(logits, ids, ell, mask, beta: float, tau: float) -> torch.Tensor:
    """TRL style: dense teacher logits (top-k scattered, the tail spread evenly over the rest), full-vocab JSD."""
    vocab, k = logits.shape[-1], ids.shape[-1]
    tail = (-torch.expm1(torch.logsumexp(ell, -1, keepdim=True))).clamp_min(1e-12)
    teacher_logits = (tail / (vocab - k)).log().expand(-1, vocab).clone().scatter_(-1, ids, ell)
    student = F.log_softmax(logits / tau, dim=-1)
    teacher = F.log_softmax(teacher_logits / tau, dim=-1)
    return _jsd(student, teacher, beta)[mask].sum()


def _loss(variant: str, logits: torch.Tensor, inp: dict, beta: float, tau: float) -> torch.Tensor:
    args = (logits, inp["ids"], inp["ell"], inp["mask"])
    if variant in ("tail", "renorm"):
        return gkd_loss(*args, beta=beta, temperature=tau, mode=variant, teacher_tail=inp["tail"])[0]
    if variant == "swift_renorm":
        return swift_renorm_loss(*args, beta, tau)
    if variant == "trl_full_jsd":
        return trl_full_jsd_loss(*args, beta, tau)
    raise ValueError(f"unknown variant {variant!r}")


def _step(variant: str, inp: dict, output_layer: bool, beta: float, tau: float, logits: torch.Tensor | None = None):
    """One forward+backward; returns seconds."""
    if variant in FUSED:
        h = inp["h"].detach().requires_grad_()
        w = inp["w"].detach().requires_grad_()
        t0 = time.perf_counter()
        loss = fused_gkd_loss(h, w, inp["ids"], inp["ell"], inp["mask"], beta=beta, temperature=tau,
                              mode=variant.removeprefix("fused_"), teacher_tail=inp["tail"]).loss
        loss.backward()
    elif output_layer:
        h = inp["h"].detach().requires_grad_()
        w = inp["w"].detach().requires_grad_()
        t0 = time.perf_counter()
        loss = _loss(variant, h @ w.t(), inp, beta, tau)
        loss.backward()
    else:
        x = logits.detach().requires_grad_()
        t0 = time.perf_counter()
        loss = _loss(variant, x, inp, beta, tau)
        loss.backward()
    return time.perf_counter() - t0


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _memory_child(variant: str, tokens: int, vocab: int, hidden: int, k: int, beta: float, tau: float) -> None:
    inp = make_inputs(tokens, vocab, hidden, k)
    small = {key: v[:8] if key != "w" else v for key, v in inp.items()}
    _step(variant, small, True, beta, tau)  # thread pools, allocator and kernels initialised outside the window
    # Not ru_maxrss: Linux carries the parent's peak into a forked/exec'd child. VmHWM is this mm's own peak, and
    # writing 5 to clear_refs resets it to the current RSS so only the step is measured.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    _step(variant, inp, True, beta, tau)
    print(json.dumps({"peak_bytes": _status_bytes("VmHWM") - before}))


def _peak_memory(variant: str, tokens: int, vocab: int, hidden: int, k: int, beta: float, tau: float) -> int | None:
    cmd = [sys.executable, __file__, "--_memory-of", variant, "--tokens", str(tokens), "--vocab", str(vocab)]
    cmd += ["--hidden", str(hidden), "--k", str(k), "--beta", str(beta), "--temperature", str(tau)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]


def _fits(variant: str, tokens: int, vocab: int) -> bool:
    if variant not in _TV_BUFFERS:
        return True
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return _TV_BUFFERS[variant] * tokens * vocab * 4 < 0.7 * avail


def _largest_fitting(variant: str, tokens: int, vocab: int) -> int | None:
    while tokens >= 256 and not _fits(variant, tokens, vocab):
        tokens //= 2
    return tokens if tokens >= 256 else None


def run(
    tokens: int = 4096,
    vocab: int = 151936,
    hidden: int = 896,
    k: int = 64,
    *,
    repeats: int = 3,
    warmup: int = 1,
    beta: float = 0.5,
    temperature: float = 1.0,
    variants: tuple[str, ...] = VARIANTS,
    memory_tokens: tuple[int, ...] = (4096,),
) -> dict:
    """Time each variant (forward + backward incl. the output layer; unfused ones also loss-only) at `tokens`, and
    measure the peak memory of each at every length in `memory_tokens`; ratios are against the ms-swift-style renorm."""
    timed = tuple(v for v in variants if _fits(v, tokens, vocab))
    inp = make_inputs(tokens, vocab, hidden, k)
    results: dict = {
        "config": {"tokens": tokens, "vocab": vocab, "hidden": hidden, "k": k, "beta": beta,
                   "temperature": temperature, "repeats": repeats, "threads": torch.get_num_threads()},
        "skipped_for_memory": [v for v in variants if v not in timed],
    }
    logits = None
    for section, output_layer in (("with_output_layer", True), ("loss_only", False)):
        names = timed if output_layer else tuple(v for v in timed if v not in FUSED)
        if not output_layer:
            with torch.no_grad():
                logits = inp["h"] @ inp["w"].t()
        times: dict[str, list[float]] = {v: [] for v in names}
        for r in range(warmup + repeats):
            order = names[r % len(names):] + names[: r % len(names)]  # rotated: shared-CPU noise hits all alike
            for v in order:
                dt = _step(v, inp, output_layer, beta, temperature, logits)
                if r >= warmup:
                    times[v].append(dt)
        med = {v: statistics.median(ts) for v, ts in times.items()}
        low = {v: min(ts) for v, ts in times.items()}
        results[section] = {
            v: {"time_s": med[v], "min_s": low[v], "times_s": times[v],
                "time_ratio": med[v] / med[REFERENCE] if REFERENCE in med else None,
                "min_ratio": low[v] / low[REFERENCE] if REFERENCE in low else None}
            for v in names
        }
    del logits, inp
    results["memory"] = {}
    for t in memory_tokens:
        row = {}
        for v in variants:
            at = _largest_fitting(v, t, vocab)
            peak = _peak_memory(v, at, vocab, hidden, k, beta, temperature) if at else None
            row[v] = {"peak_bytes": peak, "measured_at": at}
        results["memory"][str(t)] = row
    return results


def _ratio_rows(results: dict) -> list[str]:
    """The issue's rows (exact first cells, headline figure first) read back by name against the issues' goals."""
    timed, mem = results["with_output_layer"], results["memory"]
    lines = ["| fused output layer + loss (goal rows) | result | goal |", "|---|---|---|"]
    parts = []
    for t, row in mem.items():
        f, u = row["fused_tail"], row["tail"]
        if f["peak_bytes"] and u["peak_bytes"] and u["measured_at"] == int(t):
            parts.append((t, f"**{f['peak_bytes'] / u['peak_bytes']:.3f}×** at {int(t):,} tokens "
                             f"({f['peak_bytes'] / 2**30:.2f} vs {u['peak_bytes'] / 2**30:.2f} GB)"))
        elif f["peak_bytes"]:
            unf = (f"; unfused did not fit beside this machine's other work at {int(t):,}: it needs "
                   f"{u['peak_bytes'] / 2**30:.2f} GB at {u['measured_at']:,}" if u["peak_bytes"] else "")
            parts.append((t, f"fused {f['peak_bytes'] / 2**30:.2f} GB at {int(t):,} tokens{unf}"))
    lines.append("| fused vs unfused peak memory | " + "; ".join(p for _, p in parts)
                 + " | ≤ 0.20× at 4,096, ≤ 0.10× at 16,384 |")
    if "fused_tail" in timed and "tail" in timed:
        f, u = timed["fused_tail"], timed["tail"]
        lines.append(f"| fused vs unfused time | **{f['time_s'] / u['time_s']:.2f}×** (tail mode, median "
                     f"{f['time_s']:.1f} s vs {u['time_s']:.1f} s; min {f['min_s'] / u['min_s']:.2f}×) | ≤ 1.05× |")
    if "fused_tail" in timed and "fused_renorm" in timed:
        f, r = timed["fused_tail"], timed["fused_renorm"]
        ref = timed.get(REFERENCE)
        vs_ref = (f"; fused tail vs the ms-swift-style renorm on full logits: {f['time_s'] / ref['time_s']:.2f}×"
                  if ref else "")
        lines.append(f"| tail vs renorm time | **{f['time_s'] / r['time_s']:.1f}×** (both fused: {f['time_s']:.1f} s vs "
                     f"{r['time_s']:.2f} s — fused renorm needs only the k logits at the teacher's ids, so it "
                     f"gathers k rows of W instead of the vocab matmul{vs_ref}) | ≤ 1.10× |")
    return lines


def to_markdown(results: dict) -> str:
    c = results["config"]
    lines = [*_ratio_rows(results), "",
             f"T={c['tokens']} V={c['vocab']} H={c['hidden']} k={c['k']} β={c['beta']} τ={c['temperature']} "
             f"threads={c['threads']}, fp32, median and min of {c['repeats']} (min is the steadier one on a shared CPU)",
             "",
             "| variant | fwd+bwd incl. output layer: median s (× ref) | min s (× ref) "
             "| loss only: median s (× ref) | min s (× ref) |",
             "|---|---|---|---|---|"]
    for v, row in results["with_output_layer"].items():
        lo = results["loss_only"].get(v)
        only = (f"{lo['time_s']:.2f} ({lo['time_ratio']:.2f}) | {lo['min_s']:.2f} ({lo['min_ratio']:.2f})"
                if lo else "— (fused: no logits) | —")
        lines.append(f"| {v} | {row['time_s']:.2f} ({row['time_ratio']:.2f}) | {row['min_s']:.2f} "
                     f"({row['min_ratio']:.2f}) | {only} |")
    lines += ["", "| variant | " + " | ".join(f"peak RSS growth at {int(t):,} tokens, GB" for t in results["memory"])
              + " |", "|---|" + "---|" * len(results["memory"])]
    for v in VARIANTS:
        cells = []
        for t, row in results["memory"].items():
            m = row.get(v, {})
            if not m.get("peak_bytes"):
                cells.append("n/a")
            else:
                at = "" if m["measured_at"] == int(t) else f" (at {m['measured_at']:,}: {int(t):,} would not fit)"
                cells.append(f"{m['peak_bytes'] / 2**30:.2f}{at}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    if results["skipped_for_memory"]:
        lines.append(f"\nnot timed (would not fit in memory): {', '.join(results['skipped_for_memory'])}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--memory-tokens", default="4096", help="comma-separated lengths for the peak-memory rows")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the issue's figures are one thread)")
    p.add_argument("--json", help="also write the results dict here")
    p.add_argument("--_memory-of", dest="memory_of", help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.memory_of:
        _memory_child(a.memory_of, a.tokens, a.vocab, a.hidden, a.k, a.beta, a.temperature)
        return
    results = run(
        a.tokens,
        a.vocab,
        a.hidden,
        a.k,
        repeats=a.repeats,
        beta=a.beta,
        temperature=a.temperature,
        memory_tokens=tuple(int(t) for t in a.memory_tokens.split(",") if t),
    )
    print(to_markdown(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
