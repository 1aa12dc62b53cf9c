"""The transformers student backend (backend=hf) against the Megatron-Core one, Qwen3.5 training throughput, and the
fused output layer + loss on the hf backend, fp32 CPU. Part of the "Trainer" section of BENCHMARKS.md.

    python -m benchmarks.run --only train                       # with the rest of the trainer section
    python -m benchmarks.hf_bench step --json OUT               # one part in its own process

- step: the trainer's own step (`step.train_step`: forward, fused GKD loss, backward, clipping, AdamW) of the
  embedded-default student (SmolLM2 6-layer, Llama family, vocab 49,152) built once per backend by
  `setup_model_and_optimizer`, on the same random padded micro-batches (seq 1,024, micro-batch 1), both in one
  process, timed in interleaved rounds (order rotated; wall and process CPU time).
- qwen35: the hf backend's step of a 4-layer Qwen3.5 text student (3 Gated DeltaNet + 1 gated full-attention
  layer, transformers' pure-PyTorch DeltaNet fallback, hidden 256, Qwen3.5's vocab 248,320), padded (packing is
  refused for DeltaNet layers), random micro-batches of 1 x 1,024 tokens: train tokens/s, median of the rounds.
- memory: the hf backend's step at 4,096 tokens with vocab 151,936 (a 2-layer Llama-family model, hidden 256), fused
  vs unfused loss, each in a fresh process: peak resident-set growth over one step after a warm-up step (VmHWM -
  VmRSS just before it), glibc's mmap threshold pinned at 128 KiB so RSS follows live memory.
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

from benchmarks.step_bench import _rounds, _status_bytes, _summary, random_batch

ROOT = Path(__file__).resolve().parents[1]
STEP_SEQ, QWEN_SEQ, MEMORY_TOKENS = 1024, 1024, 4096
QWEN_VOCAB, MEMORY_VOCAB = 248_320, 151_936


def _trainer(student: str, backend: str, **kw) -> dict:
    from pipeline.train.config import TrainConfig
    from pipeline.train.setup import setup_model_and_optimizer, student_dir

    cfg = TrainConfig(student=student, backend=backend, train_steps=1000, warmup_steps=1, progress=False,
                      packing=False, micro_batch_size=1, global_batch_size=1, **kw)
    model, ddp, optimizer, scheduler = setup_model_and_optimizer(cfg, student_dir(cfg), backend)
    return {"cfg": cfg, "model": model, "ddp": ddp, "optimizer": optimizer, "scheduler": scheduler}


def _step(tr: dict, micro: list) -> None:
    from pipeline.train.step import train_step

    train_step(tr["cfg"], tr["ddp"], tr["optimizer"], tr["scheduler"], micro, tr["model"].hf_vocab_size)


def _qwen35(out: Path) -> Path:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=QWEN_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                            linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                            max_position_embeddings=4096, tie_word_embeddings=True)
    Qwen3_5ForCausalLM(cfg).save_pretrained(out)
    return out


def _wide_llama(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=MEMORY_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8192)
                     ).save_pretrained(out)
    return out


# ---------------------------------------------------------------- parts (each runs in its own process)


def step_time(rounds: int = 5) -> dict:
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    try:
        trainers = {b: _trainer("default", b, seq_length=STEP_SEQ) for b in ("hf", "megatron")}
        vocab = trainers["hf"]["model"].hf_vocab_size
        batches = [random_batch(vocab, 1, STEP_SEQ, seed) for seed in range(rounds + 1)]
        for tr in trainers.values():
            _step(tr, [batches[-1]])  # warm-up
        it = {b: iter(batches) for b in trainers}
        times = _rounds({b: (lambda b=b: _step(trainers[b], [next(it[b])])) for b in trainers}, rounds)
    finally:
        destroy_distributed()
    return {"seq_length": STEP_SEQ, "micro_batch_size": 1, "rounds": rounds, **_summary(*times)}


def qwen35_tokens(rounds: int = 3) -> dict:
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    with tempfile.TemporaryDirectory(prefix="gkd-qwen35-") as d:
        try:
            tr = _trainer(str(_qwen35(Path(d) / "q")), "hf", seq_length=QWEN_SEQ)
            batches = [random_batch(QWEN_VOCAB, 1, QWEN_SEQ, seed) for seed in range(rounds + 1)]
            _step(tr, [batches[-1]])
            it = iter(batches)
            times = _rounds({"qwen35": lambda: _step(tr, [next(it)])}, rounds)
            params = sum(p.numel() for p in tr["model"].parameters())
        finally:
            destroy_distributed()
    res = {"seq_length": QWEN_SEQ, "rounds": rounds, "parameters": params, **_summary(*times)}
    return {**res, "tokens_per_s": QWEN_SEQ / res["median_s"]["qwen35"]}


def memory(fused: bool) -> dict:
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    with tempfile.TemporaryDirectory(prefix="gkd-hfmem-") as d:
        try:
            tr = _trainer(str(_wide_llama(Path(d) / "m")), "hf", seq_length=MEMORY_TOKENS, fused_loss=fused)
            batch = random_batch(MEMORY_VOCAB, 1, MEMORY_TOKENS, 0)
            _step(tr, [batch])  # warm-up: optimizer state and gradients exist before the measured step
            with open("/proc/self/clear_refs", "w") as f:  # 5: reset VmHWM to the current RSS
                f.write("5")
            before = _status_bytes("VmRSS")
            t = time.perf_counter()
            _step(tr, [batch])
            return {"fused": fused, "peak_growth_bytes": _status_bytes("VmHWM") - before, "rss_before_bytes": before,
                    "wall_s": time.perf_counter() - t}
        finally:
            destroy_distributed()


# ---------------------------------------------------------------- driver


def _child(args: list[str], env: dict | None = None) -> dict:
    out = Path(tempfile.gettempdir()) / f"hf-bench-{os.getpid()}-{'-'.join(args)}.json"
    subprocess.run([sys.executable, "-m", "benchmarks.hf_bench", *args, "--json", str(out)], check=True, cwd=ROOT,
                   env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())
    out.unlink()
    return res


def run() -> dict:
    """All parts, each in a fresh process."""
    mmap = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    return {"step": _child(["step"]), "qwen35": _child(["qwen35"]),
            "memory": {name: _child(["memory", "--fused", name], env=mmap) for name in ("true", "false")}}


def markdown(res: dict) -> list[str]:
    """Rows for the trainer table (| name | value | goal |): the issue's first cells, headline figure first."""
    st, q, mem = res["step"], res["qwen35"], res["memory"]
    h, m = st["median_s"]["hf"], st["median_s"]["megatron"]
    cpu = st["median_cpu_s"]["hf"] / st["median_cpu_s"]["megatron"]
    fused, unfused = mem["true"]["peak_growth_bytes"], mem["false"]["peak_growth_bytes"]
    return [
        f"| hf vs megatron backend step time | {h / m:.2f}× ({h:.2f} s vs {m:.2f} s per step, CPU time {cpu:.2f}×; "
        f"the default SmolLM2 6-layer student, fused loss, fp32, seq {st['seq_length']:,}, micro-batch 1, random "
        f"tokens, median of {st['rounds']} interleaved rounds) | ≤ 1.3× |",
        f"| hf backend qwen3.5 train tokens/s | {q['tokens_per_s']:.0f} tokens/s ({q['median_s']['qwen35']:.2f} s "
        f"per step of 1 × {q['seq_length']:,} tokens, padded: packing is refused for DeltaNet layers; 4 layers (3 "
        f"Gated DeltaNet + 1 full attention, transformers' PyTorch fallback kernels), hidden 256, vocab "
        f"{QWEN_VOCAB:,}, {q['parameters'] / 1e6:.1f}M parameters; fused loss, fp32, median of {q['rounds']} "
        "rounds) | (report) |",
        f"| hf backend fused vs unfused peak memory | {fused / unfused:.3f}× ({fused / 2**30:.2f} GiB vs "
        f"{unfused / 2**30:.2f} GiB peak growth over one step; {MEMORY_TOKENS:,} tokens, vocab {MEMORY_VOCAB:,}, a "
        "2-layer Llama-family model of hidden 256, fp32; each in a fresh process) | ≤ 0.20× |",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["step", "qwen35", "memory"])
    ap.add_argument("--fused", default="true", choices=["true", "false"])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    kw = {} if args.rounds is None else {"rounds": args.rounds}
    if args.part == "step":
        res = step_time(**kw)
    elif args.part == "qwen35":
        res = qwen35_tokens(**kw)
    else:
        res = memory(args.fused == "true")
    Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
