"""LoRA export vs full export for the embedded-default student (SmolLM2 6-layer, Megatron-Core, fp32, CPU).

    python -m benchmarks.run --only lora

What the on-policy loop ships to the sampler each cycle: the full HF folder (`gkd export`), or the peft adapter
(`gkd export --adapter-only`). Both are timed in this process, interleaved, median of `rounds`; the merged export
(base + adapter folded, `--merged`) is timed too. The adapter is random and non-zero (a trained one has the same
size). Sizes are the bytes of the weight files written.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from pipeline.assets import student_dir


def _size(folder: Path, pattern: str) -> int:
    return sum(f.stat().st_size for f in folder.glob(pattern))


def run(work: Path | None = None, rank: int = 16, rounds: int = 3) -> dict:
    import torch

    from pipeline.train.models.lora import TARGETS, LoRASpec, apply_lora, lora_state_dict
    from pipeline.train.models.megatron import build_model, export_adapter, export_hf, load_hf_weights
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    work = Path(work or tempfile.mkdtemp(prefix="lora-bench-"))
    hf = student_dir()
    spec = LoRASpec(rank, 2.0 * rank, TARGETS)
    init_distributed(tp=1, pp=1, seed=0)
    try:
        full = build_model(hf)
        load_hf_weights(full, hf)
        lora = build_model(hf)
        load_hf_weights(lora, hf)
        apply_lora(lora, spec)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for t in lora_state_dict(lora).values():
                t.copy_(0.01 * torch.randn(t.shape, generator=g))
        times: dict[str, list[float]] = {"full": [], "adapter": [], "merged": []}
        for _ in range(rounds):
            for name, fn in (("full", lambda: export_hf(full, hf, work / "full")),
                             ("adapter", lambda: export_adapter(lora, hf, work / "adapter")),
                             ("merged", lambda: export_hf(lora, hf, work / "merged"))):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        n_adapter = sum(t.numel() for t in lora_state_dict(lora).values())
        n_full = sum(p.numel() for p in full.parameters())
    finally:
        destroy_distributed()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "student": str(hf), "rank": rank, "alpha": spec.alpha, "targets": list(TARGETS), "rounds": rounds,
        "params_full": n_full, "params_adapter": n_adapter,
        "bytes_full": _size(work / "full", "*.safetensors"), "bytes_adapter": _size(work / "adapter", "*.safetensors"),
        "bytes_merged": _size(work / "merged", "*.safetensors"), "seconds": med, "all_seconds": times,
    }


def markdown(r: dict) -> str:
    s, mb = r["seconds"], 1 << 20
    return "\n".join([
        f"Student: the embedded default (SmolLM2 6-layer, {r['params_full'] / 1e6:.1f}M parameters, fp32); "
        f"LoRA rank {r['rank']}, alpha {r['alpha']:g}, on {', '.join(r['targets'])} "
        f"({r['params_adapter'] / 1e6:.2f}M adapter parameters). Median of {r['rounds']} interleaved rounds.",
        "",
        "| export | weight bytes | seconds | vs full |",
        "|---|---|---|---|",
        f"| full weights (`gkd export`) | {r['bytes_full'] / mb:.1f} MiB | {s['full']:.2f} | 1.00× |",
        f"| **adapter only, peft format (`--adapter-only`)** | **{r['bytes_adapter'] / mb:.2f} MiB** | "
        f"**{s['adapter']:.3f}** | {r['bytes_adapter'] / r['bytes_full']:.3f}× size, "
        f"{s['adapter'] / s['full']:.3f}× time |",
        f"| merged base + adapter (`--merged`) | {r['bytes_merged'] / mb:.1f} MiB | {s['merged']:.2f} | "
        f"{s['merged'] / s['full']:.2f}× time |",
    ])


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
