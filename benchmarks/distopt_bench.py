"""Megatron's distributed optimizer vs the plain one at DP=2: optimizer state per rank and step time (issue #33).

    python -m benchmarks.run --only distopt

Two `torchrun --nproc_per_node 2 -m pipeline.train.run` runs of the same random Qwen2-shaped student (fp32, Adam,
CPU, gloo) on the same synthetic cache (benchmarks/gpu_bench.py's: random tokens and a random top-64 teacher; the
data does not change the state's size), `use_distributed_optimizer` false then true. The bytes are the trainer's own
metric `optimizer_state_bytes`: the most any rank holds of Adam's moments (plus fp32 master copies, none in fp32),
counted after the first step. Step time: the median of the steps after the first.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu_bench import build_cache, build_student

ROOT = Path(__file__).resolve().parents[1]
# ~17M parameters: large enough that the per-bucket padding of the sharded buffers is noise
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=8192, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)


def _train(student: Path, cache: Path, save: Path, distributed: bool, steps: int, seq: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = ["backend=megatron", f"student={student}", f"cache=[{cache}]", "micro_batch_size=1", "global_batch_size=2",
            f"seq_length={seq}", f"train_steps={steps}", "warmup_steps=0", "optimizer=adam", f"save_dir={save}",
            f"save_interval={steps}", "progress=false", f"use_distributed_optimizer={str(distributed).lower()}"]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "pipeline.train.run", *args], check=True, env=env, cwd=ROOT, timeout=1800,
                   stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def run(work: Path | None = None, steps: int = 4, seq: int = 256) -> dict:
    work = Path(work or tempfile.mkdtemp(prefix="distopt-bench-"))
    student = build_student(work / "student", SHAPE)
    cache = build_cache(work / "cache", student, tokens=seq, rows=2 * steps, vocab=SHAPE["vocab_size"])
    res: dict = {"shape": SHAPE, "steps": steps, "seq_length": seq, "dp": 2}
    for name, distributed in (("plain", False), ("distributed", True)):
        metrics = _train(student, cache, work / name, distributed, steps, seq)
        res[name] = {"optimizer_state_bytes": metrics[0]["optimizer_state_bytes"],
                     "step_seconds": statistics.median(m["step_seconds"] for m in metrics[1:]),
                     "losses": [m["loss"] for m in metrics]}
    from safetensors.torch import load_file

    res["params"] = sum(t.numel() for t in load_file(student / "model.safetensors").values())
    return res


def markdown(r: dict) -> str:
    mib = 1 << 20
    p, d = r["plain"], r["distributed"]
    ratio = d["optimizer_state_bytes"] / p["optimizer_state_bytes"]
    return "\n".join([
        f"Student: a random Qwen2-shaped model ({r['params'] / 1e6:.1f}M parameters, {r['shape']['num_hidden_layers']} "
        f"layers, hidden {r['shape']['hidden_size']}, vocab {r['shape']['vocab_size']}), fp32, Adam, DP=2 under "
        f"torchrun (gloo), {r['steps']} steps of 2 rows x {r['seq_length']} tokens; the two runs one after the other.",
        "",
        "| measure | value | goal |",
        "|---|---|---|",
        f"| distributed optimizer state per rank, DP=2 | **{ratio:.3f}×** "
        f"({d['optimizer_state_bytes'] / mib:.1f} MiB vs {p['optimizer_state_bytes'] / mib:.1f} MiB without) | ≤ 0.55× |",
        f"| step time, distributed vs plain optimizer, DP=2 | {d['step_seconds'] / p['step_seconds']:.2f}× "
        f"({d['step_seconds']:.2f} s vs {p['step_seconds']:.2f} s) | — |",
    ])


if __name__ == "__main__":
    out = run()
    print(json.dumps(out, indent=1))
    print(markdown(out))
