"""Loss benchmark: our GKD ``tail`` / ``renorm`` loss vs an ms-swift-style renorm and a TRL-style full-vocab JSD.

Run: ``python benchmarks/loss_bench.py --tokens 1024`` (prints a markdown table; 4096 tokens takes many minutes and,
for the TRL-style variant, more memory than a 23 GB machine has: it is skipped when it would not fit).

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

from pipeline.train.loss import gkd_loss

VARIANTS = ("tail", "renorm", "swift_renorm", "trl_full_jsd")
REFERENCE = "swift_renorm"
# [T, V] fp32 buffers alive at the TRL-style variant's peak (measured ≈ 11 at 256 tokens; rounded up for safety).
_TRL_TV_BUFFERS = 12


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
    return {"h": h, "w": w, "ids": ids, "ell": ell, "mask": torch.ones(tokens, dtype=torch.bool)}


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
        return gkd_loss(*args, beta=beta, temperature=tau, mode=variant)[0]
    if variant == "swift_renorm":
        return swift_renorm_loss(*args, beta, tau)
    if variant == "trl_full_jsd":
        return trl_full_jsd_loss(*args, beta, tau)
    raise ValueError(f"unknown variant {variant!r}")


def _step(variant: str, inp: dict, output_layer: bool, beta: float, tau: float, logits: torch.Tensor | None = None):
    """One forward+backward; returns seconds."""
    if output_layer:
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
    if variant != "trl_full_jsd":
        return True
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return _TRL_TV_BUFFERS * tokens * vocab * 4 < 0.7 * avail


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
    memory: bool = True,
) -> dict:
    """Time (and measure peak memory of) each variant; ratios are against the ms-swift-style renorm reference."""
    variants = tuple(v for v in variants if _fits(v, tokens, vocab))
    skipped = [v for v in VARIANTS if v not in variants]
    inp = make_inputs(tokens, vocab, hidden, k)
    with torch.no_grad():
        logits = inp["h"] @ inp["w"].t()
    results: dict = {
        "config": {
            "tokens": tokens,
            "vocab": vocab,
            "hidden": hidden,
            "k": k,
            "beta": beta,
            "temperature": temperature,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
        },
        "skipped_for_memory": skipped,
    }
    for section, output_layer in (("with_output_layer", True), ("loss_only", False)):
        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(warmup + repeats):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                dt = _step(v, inp, output_layer, beta, temperature, logits)
                if r >= warmup:
                    times[v].append(dt)
        med = {v: statistics.median(ts) for v, ts in times.items()}
        low = {v: min(ts) for v, ts in times.items()}
        results[section] = {
            v: {
                "time_s": med[v],
                "min_s": low[v],
                "times_s": times[v],
                "time_ratio": med[v] / med[REFERENCE] if REFERENCE in med else None,
                "min_ratio": low[v] / low[REFERENCE] if REFERENCE in low else None,
            }
            for v in variants
        }
    if memory:
        del logits
        peaks = {v: _peak_memory(v, tokens, vocab, hidden, k, beta, temperature) for v in variants}
        ref = peaks.get(REFERENCE)
        for v in variants:
            results["with_output_layer"][v]["peak_bytes"] = peaks[v]
            results["with_output_layer"][v]["mem_ratio"] = peaks[v] / ref if peaks[v] and ref else None
    return results


def to_markdown(results: dict) -> str:
    c = results["config"]
    lines = [
        f"T={c['tokens']} V={c['vocab']} H={c['hidden']} k={c['k']} β={c['beta']} τ={c['temperature']} "
        f"threads={c['threads']}, median and min of {c['repeats']} (min is the steadier one on a shared CPU)",
        "",
        "| variant | fwd+bwd incl. output layer: median s (× ref) | min s (× ref) | peak RSS growth GB (× ref) "
        "| loss only: median s (× ref) | min s (× ref) |",
        "|---|---|---|---|---|---|",
    ]
    for v, row in results["with_output_layer"].items():
        lo = results["loss_only"][v]
        peak = row.get("peak_bytes")
        mem = f"{peak / 2**30:.2f} ({row['mem_ratio']:.2f})" if peak and row.get("mem_ratio") else "n/a"
        lines.append(
            f"| {v} | {row['time_s']:.2f} ({row['time_ratio']:.2f}) | {row['min_s']:.2f} ({row['min_ratio']:.2f}) "
            f"| {mem} | {lo['time_s']:.2f} ({lo['time_ratio']:.2f}) | {lo['min_s']:.2f} ({lo['min_ratio']:.2f}) |"
        )
    if results["skipped_for_memory"]:
        lines.append(f"\nskipped (would not fit in memory): {', '.join(results['skipped_for_memory'])}")
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
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--json", help="also write the results dict here")
    p.add_argument("--_memory-of", dest="memory_of", help=argparse.SUPPRESS)
    a = p.parse_args()
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
        memory=not a.no_memory,
    )
    print(to_markdown(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
