"""BENCHMARKS.md: its sections, each stamped with the command, time and machine that measured it.

`make bench` (benchmarks/run.py) and `make faults` (benchmarks/faults.py) both write through here, so that
re-measuring one section keeps the others.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, load average at start {load:.1f}"


SECTIONS = {  # name -> heading, in file order
    "score": "Score stage and the cache (issues: foundation, score)",
    "scorework": "The score stage at GPU speed: fingerprint record, the stage's own work, a replayed fast teacher (issue #34)",
    "served": "Served teacher vs in-process scoring (issues #19, #36: a served teacher, on the openai client)",
    "interop": "Cache export and import (issue #36: a cache every tool reads)",
    "loss": "GKD loss (issue: train stage)",
    "train": "Trainer (issue: train stage)",
    "gpu": "Train step on a GPU: fused vs unfused output layer + loss, MFU, Qwen3.5 with and without FLA, the CUDA tests "
           "(benchmarks/gpu_check.py, gpu_bench.py)",
    "hf": "Transformers student backend vs Megatron-Core, Qwen3.5 (issue #30: any student)",
    "lora": "LoRA students: adapter export vs full export (issue: LoRA)",
    "baselines": "Cache vs live teacher: step time and break-even (issue: honest baselines)",
    "onpolicy": "On-policy vs off-policy GKD (issue: on-policy)",
    "overlap": "Overlapped on-policy cycles: max_staleness=1 vs the strict order, replayed and real engines (issue 47)",
    "opd": "On-policy OPD (k=0 rows) vs GKD's tail loss (k=64 rows) (issue: top-p and k=0)",
    "topp": "Top-p caches: distillation quality against fixed k (issue: top-p and k=0)",
    "faults": "Faults: kill -9, full disk, two writers, bad inputs (issue: faults)",
    "lifetime": "Processes left after kill -9: score, generate, train, on-policy (issue #35: no process outlives its command)",
    "ray": "Ray executor: on-policy wall time vs local, score workers killed (issue #32: Ray)",
    "images": "Image prompts: a vision-language teacher with and without the images (issue #31: images)",
    "distopt": "Distributed optimizer: state per rank at DP=2 (issue #33: scale)",
    "index": "Cache index: start-up, memory and commit cost at 10^3-10^5 shards (issue #33: scale)",
    "cp": "Context parallelism: peak memory per rank and step time, CP=2 vs CP=1 at 16k tokens (issue #33: scale)",
    "pp": "Pipeline parallelism: peak memory per rank PP=2 vs PP=1, interleaved 1F1B step time (issue 48)",
    "xtok": "Cross-tokenizer distillation from the cache: GOLD vs SFT, bytes, step time (issue #37)",
    "exact": "The exact teacher from a cache: hidden-state cache bytes, train step vs top-64 and vs SFT, held-out quality (issue #50)",
    "overlapkills": "Overlapped on-policy runs killed -9 at every role and the driver, rerun (issue 47)",
}
@dataclass(frozen=True)
class Stamp:
    """Which command measured a section, when, and on what machine (load taken when the section starts)."""

    command: str
    started: str
    machine: str

    @classmethod
    def now(cls, command: str) -> Stamp:
        return cls(command, datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), machine())


def section(name: str, body: str, raw: dict, stamp: Stamp) -> str:
    return "\n".join([
        f"<!-- bench:{name} -->", f"## {SECTIONS[name]}", "",
        f"_Measured by `{stamp.command}` on {stamp.started}; {stamp.machine}._", "", body, "",
        "<details><summary>raw results</summary>", "", "```json", json.dumps(raw, indent=1, default=str), "```",
        "</details>", f"<!-- /bench:{name} -->", "",
    ])


def old_sections(path: Path) -> dict[str, str]:
    """Sections of an existing BENCHMARKS.md, so that `--only x` replaces section x and keeps the others."""
    text = path.read_text() if path.exists() else ""
    found = re.findall(r"(<!-- bench:(\w+) -->.*?<!-- /bench:\2 -->\n)", text, flags=re.S)
    return {name: block for block, name in found}


def stored_raw(block: str) -> dict:
    """The raw results of a section as `section` wrote them, each top-level part stamped with the section's
    `measured` line (so a part kept while another is re-measured still says which run measured it)."""
    raw = re.search(r"```json\n(.*?)\n```", block, flags=re.S)
    if raw is None:
        return {}
    stamp = re.search(r"^_Measured by (.*)\._$", block, flags=re.M)
    out = json.loads(raw.group(1))
    for part in out.values():
        if isinstance(part, dict) and stamp is not None:
            part.setdefault("measured", stamp.group(1))
    return out


def measure_parts(section: str, flag: str, measure: dict[str, Callable[[], dict]], parts: Sequence[str],
                  kept: dict) -> dict:
    """A section in parts (`measure`, in order): those in `parts` measured now, the others taken from `kept` (the
    section's stored raw results, each stamped by `stored_raw` with the run that measured it), so one part can be
    re-measured alone; `flag` is the command-line option that picks them."""
    missing = [p for p in measure if p not in parts and p not in kept]
    if missing:
        raise ValueError(f"{section} bench: no stored results of {missing} to keep; measure them ({flag})")
    return {p: measure[p]() if p in parts else kept[p] for p in measure}


def write_benchmarks(path: Path, sections: dict[str, str]) -> str:
    """Write BENCHMARKS.md from its sections (in SECTIONS order); returns the text."""
    text = "\n".join([
        "# Benchmarks", "",
        "Generated by `make bench` (`python -m benchmarks.run`; `--only NAME` re-measures one section and keeps the "
        "others). Each section names the command and machine that produced it. Do not edit by hand.", "",
        *(sections[name] for name in SECTIONS if name in sections),
    ])
    path.write_text(text)
    return text
