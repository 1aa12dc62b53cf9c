"""Trainer compute: attention backend (sdpa vs Megatron's local attention) and our whole Megatron-Core step against a
plain transformers loop, on the embedded-default student (SmolLM2 6-layer), fp32 CPU.

    python -m benchmarks.run --only train                              # part of the "Trainer" section
    python -m benchmarks.step_bench attention --json OUT               # one part in its own process
    python -m benchmarks.step_bench plain --cache DIR --json OUT

- attention: our trainer's step (`run.train_step`: forward, GKD loss, backward, clipping, AdamW) at seq 2,048,
  micro-batch 1, once with `attention=sdpa` and once with `attention=local`, both trainers built in one process and
  timed in interleaved rounds (order rotated; wall and process CPU time). Random tokens and random teacher top-k
  rows: step time does not depend on the data. Memory: each variant in a fresh process, one warm-up step, then the peak resident-set growth over one
  step (VmHWM - VmRSS just before it, peak reset via /proc/self/clear_refs), with glibc's mmap threshold pinned at
  128 KiB so freed activations go back to the OS and RSS follows live memory.
- precision: the same step with `bf16=true` (Float16Module, fp32 main weights and optimizer) against fp32, at seq
  1,024, both trainers in one process, interleaved rounds.
- plain: our trainer step (padded micro-batches, no packing: like with like) against a plain transformers loop on
  the same micro-batches of a real cache: `AutoModelForCausalLM` (its default SDPA attention) -> logits ->
  `pipeline.train.losses.reference.gkd_loss` (same beta, temperature, mode, stored teacher tail; normalised by the active
  count) -> backward ->
  `clip_grad_norm_` (our trainer clips at clip_grad) -> `torch.optim.AdamW` (same betas, eps, lr). Micro-batches are
  decoded before timing, so neither side pays for data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SEQ, K = 2048, 64


def _status_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _trainer(**kw):
    """Our trainer's model, DDP wrapper, optimizer and scheduler, built by run.py's own setup."""
    from pipeline.train.config import TrainConfig
    from pipeline.train.setup import setup_model_and_optimizer, student_dir

    kw.setdefault("packing", False)  # padded micro-batches in this bench (packing is measured apart)
    cfg = TrainConfig(student="default", train_steps=1000, warmup_steps=1, progress=False, **kw)
    hf_dir = student_dir(cfg)
    model, ddp, optimizer, scheduler = setup_model_and_optimizer(cfg, hf_dir)
    return {"cfg": cfg, "model": model, "ddp": ddp, "optimizer": optimizer, "scheduler": scheduler, "hf_dir": hf_dir}


def _step(tr: dict, micro: list) -> None:
    from pipeline.train.step import train_step

    train_step(tr["cfg"], tr["ddp"], tr["optimizer"], tr["scheduler"], micro, tr["model"].hf_vocab_size)


def random_batch(vocab: int, batch: int, seq: int, seed: int):
    """A padded-layout MicroBatch of random tokens (one sample per row, no padding) with random distinct top-k
    teacher ids and sorted logprobs (5 % tail mass)."""
    from pipeline.train.data.batch import MicroBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    gaps = torch.randint(1, vocab // K, (batch, seq, K), generator=g)
    teacher_ids = ((torch.randint(0, vocab, (batch, seq, 1), generator=g) + gaps.cumsum(-1)) % vocab).int()
    ell = torch.log_softmax(2 * torch.randn(batch, seq, K, generator=g), -1) + math.log(0.95)
    ell = ell.sort(-1, descending=True).values
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[:, -1] = False
    return MicroBatch(input_ids=ids, position_ids=torch.arange(seq).expand(batch, seq).contiguous(),
                      labels=ids.roll(-1, 1), loss_mask=mask, sft_mask=torch.zeros_like(mask),
                      doc_ids=torch.zeros(batch, seq, dtype=torch.int32), teacher_ids=teacher_ids,
                      teacher_logprobs=ell, teacher_valid=torch.ones(batch, seq, K, dtype=torch.bool),
                      teacher_tail=torch.full((batch, seq), math.log(0.05)), teacher_actual=torch.zeros(batch, seq),
                      keys=[], packed=False, end=0,
                      tokens=batch * seq, positions=batch * seq, samples=batch, truncated=0, folded_positions=0)


def _rounds(fns: dict, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and process-CPU seconds of each fn over `rounds` interleaved rounds (order rotated each round). CPU time
    is reported beside wall time because the machine is shared: other jobs stretch wall time, not our CPU time."""
    names = list(fns)
    wall, cpu = {n: [] for n in fns}, {n: [] for n in fns}
    for r in range(rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            t, c = time.perf_counter(), time.process_time()
            fns[n]()
            wall[n].append(time.perf_counter() - t)
            cpu[n].append(time.process_time() - c)
    return wall, cpu


def _summary(wall: dict, cpu: dict) -> dict:
    return {"seconds": wall, "cpu_seconds": cpu, "median_s": {n: statistics.median(t) for n, t in wall.items()},
            "median_cpu_s": {n: statistics.median(t) for n, t in cpu.items()}}


# ---------------------------------------------------------------- parts (each runs in its own process)


def attention_time(rounds: int = 3) -> dict:
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    try:
        trainers = {a: _trainer(attention=a, micro_batch_size=1, global_batch_size=1, seq_length=SEQ)
                    for a in ("sdpa", "local")}
        vocab = trainers["sdpa"]["model"].hf_vocab_size
        batches = [random_batch(vocab, 1, SEQ, seed) for seed in range(rounds + 1)]
        for tr in trainers.values():
            _step(tr, [batches[-1]])  # warm-up
        it = {a: iter(batches) for a in trainers}
        times = _rounds({a: (lambda a=a: _step(trainers[a], [next(it[a])])) for a in trainers}, rounds)
    finally:
        destroy_distributed()
    return {"seq_length": SEQ, "micro_batch_size": 1, "rounds": rounds, **_summary(*times)}


def precision_time(rounds: int = 3, seq: int = 1024) -> dict:
    """bf16 mixed precision (Float16Module, fp32 main weights) against fp32: the same random micro-batches, both
    trainers in one process, interleaved rounds. On CPU bf16 matmuls are fast only where the CPU has bf16 units."""
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    try:
        trainers = {name: _trainer(bf16=bf16, micro_batch_size=1, global_batch_size=1, seq_length=seq)
                    for name, bf16 in (("bf16", True), ("fp32", False))}
        vocab = trainers["fp32"]["model"].hf_vocab_size
        batches = [random_batch(vocab, 1, seq, s) for s in range(rounds + 1)]
        for tr in trainers.values():
            _step(tr, [batches[-1]])
        it = {n: iter(batches) for n in trainers}
        times = _rounds({n: (lambda n=n: _step(trainers[n], [next(it[n])])) for n in trainers}, rounds)
    finally:
        destroy_distributed()
    return {"seq_length": seq, "micro_batch_size": 1, "rounds": rounds, "cpu_bf16": cpu_bf16_units(),
            **_summary(*times)}


def cpu_bf16_units() -> list[str]:
    """The CPU's bf16 instruction sets (/proc/cpuinfo flags). Without them a bf16 matmul converts to fp32 to compute
    and is slower than fp32: bf16 vs fp32 measured 0.29x on an Icelake VM that has none, 1.72x on an AMD EPYC VM
    (whose flags were not recorded then)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "avx_ne_convert"))


def attention_memory(attention: str, recompute: str = "none") -> dict:
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    try:
        tr = _trainer(attention=attention, recompute=recompute, micro_batch_size=1, global_batch_size=1, seq_length=SEQ)
        batch = random_batch(tr["model"].hf_vocab_size, 1, SEQ, 0)
        _step(tr, [batch])  # warm-up: optimizer state, grad buffers and caches exist before the measured step
        with open("/proc/self/clear_refs", "w") as f:  # 5: reset VmHWM to the current RSS
            f.write("5")
        before = _status_bytes("VmRSS")
        t, c = time.perf_counter(), time.process_time()
        _step(tr, [batch])
        return {"peak_growth_bytes": _status_bytes("VmHWM") - before, "rss_before_bytes": before,
                "wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c}
    finally:
        destroy_distributed()


def plain_vs_trainer(cache: str, rounds: int = 3, micro_batch_size: int = 8, seq_length: int = 512) -> dict:
    import transformers

    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.losses.reference import gkd_loss
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    try:
        tr = _trainer(micro_batch_size=micro_batch_size, global_batch_size=micro_batch_size, seq_length=seq_length,
                      cache=[str(cache)])
        cfg, hf_dir = tr["cfg"], tr["hf_dir"]
        tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
        loader = ScoredLoader([cache], micro_batch_size=micro_batch_size, seq_length=seq_length, seed=cfg.seed,
                              pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                              vocab_size=tr["model"].hf_vocab_size, window_rows=cfg.window_rows)
        batches = [loader.micro_batch(m) for m in range(rounds + 1)]
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).train()
        adamw = torch.optim.AdamW(hf.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)
        vocab = tr["model"].hf_vocab_size

        def plain(mb) -> None:
            logits = hf(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
            kd_sum, n = gkd_loss(logits, mb.teacher_ids, mb.teacher_logprobs, mb.loss_mask, beta=cfg.kd_beta,
                                 temperature=cfg.temperature, mode=cfg.topk_mode, teacher_tail=mb.teacher_tail,
                                 teacher_valid=mb.teacher_valid, vocab_size=vocab)
            (kd_sum / n.clamp_min(1)).backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg.clip_grad)
            adamw.step()
            adamw.zero_grad(set_to_none=True)

        _step(tr, [batches[-1]])
        plain(batches[-1])  # warm-up both
        it = {"ours": iter(batches), "plain": iter(batches)}
        times = _rounds({"ours": lambda: _step(tr, [next(it["ours"])]), "plain": lambda: plain(next(it["plain"]))},
                        rounds)
        shapes = [list(b.input_ids.shape) for b in batches[:rounds]]
    finally:
        destroy_distributed()
    res = {"micro_batch_size": micro_batch_size, "seq_length": seq_length, "rounds": rounds, "shapes": shapes,
           **_summary(*times)}
    return {**res, "ratio": res["median_s"]["ours"] / res["median_s"]["plain"],
            "cpu_ratio": res["median_cpu_s"]["ours"] / res["median_cpu_s"]["plain"]}


# ---------------------------------------------------------------- driver


def _child(args: list[str], env: dict | None = None) -> dict:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"step-bench-{os.getpid()}-{args[0]}-{len(args)}.json"
    cmd = [sys.executable, "-m", "benchmarks.step_bench", *args, "--json", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())
    out.unlink()
    return res


def run(cache: str | Path) -> dict:
    """All parts, each in a fresh process."""
    mmap = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # see the module docstring
    return {
        "attention": _child(["attention"]),
        "attention_memory": {a: _child(["memory", "--attention", a], env=mmap) for a in ("sdpa", "local")},
        "plain": _child(["plain", "--cache", str(cache)]),
        "precision": _child(["precision"]),
    }


def markdown(res: dict) -> list[str]:
    """Rows for the trainer table (| name | value | goal |)."""
    att, mem, pl = res["attention"], res["attention_memory"], res["plain"]
    s, loc = att["median_s"]["sdpa"], att["median_s"]["local"]
    cpu_att = att["median_cpu_s"]["sdpa"] / att["median_cpu_s"]["local"]
    gib = {a: mem[a]["peak_growth_bytes"] / 2**30 for a in mem}
    shapes = sorted({tuple(x) for x in pl["shapes"]})
    rows = [
        f"| sdpa vs local attention step time | {s / loc:.2f}× ({s:.2f} s vs {loc:.2f} s per step, CPU time "
        f"{cpu_att:.2f}×; peak memory over a "
        f"step {gib['sdpa']:.2f} GiB vs {gib['local']:.2f} GiB; seq {att['seq_length']:,}, micro-batch 1, random "
        f"tokens, median of {att['rounds']} interleaved rounds) | ≤ 1.0× |",
        f"| trainer vs plain transformers step time | {pl['ratio']:.2f}× ({pl['median_s']['ours']:.2f} s vs "
        f"{pl['median_s']['plain']:.2f} s per step, CPU time {pl['cpu_ratio']:.2f}×; micro-batches {', '.join('×'.join(map(str, x)) for x in shapes)} "
        f"of the prose cache, padded; median of {pl['rounds']} interleaved rounds) | ≤ 1.0× |",
    ]
    if "precision" in res:
        pr = res["precision"]
        b, f = pr["median_s"]["bf16"], pr["median_s"]["fp32"]
        tok = pr["seq_length"] * pr["micro_batch_size"]
        rows.append(
            f"| bf16 vs fp32 train step tokens/s | {f / b:.2f}× ({tok / b:.0f} vs {tok / f:.0f} tokens/s; CPU time "
            f"{pr['median_cpu_s']['fp32'] / pr['median_cpu_s']['bf16']:.2f}×; Float16Module with fp32 main weights; "
            f"seq {pr['seq_length']:,}, micro-batch 1, random tokens, median of {pr['rounds']} interleaved rounds; "
            f"{torch.backends.cpu.get_cpu_capability()} CPU{_bf16_units_note(pr)}) | (report) |")
    return rows


def _bf16_units_note(precision: dict) -> str:
    if "cpu_bf16" not in precision:  # measured before the flags were recorded
        return ""
    units = precision["cpu_bf16"]
    if units:
        return f", bf16 instructions: {', '.join(units)}"
    return ", no bf16 instructions (bf16 matmuls compute via fp32)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["attention", "memory", "plain", "precision"])
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--recompute", default="none", help="memory part only")
    ap.add_argument("--cache")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    if args.part == "attention":
        res = attention_time(args.rounds)
    elif args.part == "precision":
        res = precision_time(args.rounds)
    elif args.part == "memory":
        res = attention_memory(args.attention, args.recompute)
    else:
        if not args.cache:
            ap.error("plain needs --cache")
        res = plain_vs_trainer(args.cache, args.rounds)
    Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

