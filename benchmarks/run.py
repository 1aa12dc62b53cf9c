"""`make bench`: every benchmark side by side, written to BENCHMARKS.md (the command is recorded in the file).

    python -m benchmarks.run [--only score,served,loss,train,lora,baselines,onpolicy,faults] [--loss-tokens 4096]

Each number is measured in this run on this machine; ratios compare variants run in the same process, interleaved,
because the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    "served": "Served teacher vs in-process scoring (issue #19: a served teacher)",
    "loss": "GKD loss (issue: train stage)",
    "train": "Trainer (issue: train stage)",
    "lora": "LoRA students: adapter export vs full export (issue: LoRA)",
    "baselines": "Cache vs live teacher: step time and break-even (issue: honest baselines)",
    "onpolicy": "On-policy vs off-policy GKD (issue: on-policy)",
    "opd": "On-policy OPD (k=0 rows) vs GKD's tail loss (k=64 rows) (issue: top-p and k=0)",
    "topp": "Top-p caches: distillation quality against fixed k (issue: top-p and k=0)",
    "faults": "Faults: kill -9, full disk, two writers, bad inputs (issue: faults)",
}
DEFAULT = "score,served,loss,train,lora,baselines,topp"  # onpolicy and opd run whole on-policy runs (~1 h on 2 cores), faults
# (`make faults`) ~20 kills of three commands and the fault tests: ask for them


def _section(name: str, body: str, raw: dict, command: str, started: str) -> str:
    return "\n".join([
        f"<!-- bench:{name} -->", f"## {SECTIONS[name]}", "",
        f"_Measured by `{command}` on {started}; {machine()}._", "", body, "",
        "<details><summary>raw results</summary>", "", "```json", json.dumps(raw, indent=1, default=str), "```",
        "</details>", f"<!-- /bench:{name} -->", "",
    ])


def _old_sections(path: Path) -> dict[str, str]:
    """Sections of an existing BENCHMARKS.md, so that `--only x` replaces section x and keeps the others."""
    text = path.read_text() if path.exists() else ""
    found = re.findall(r"(<!-- bench:(\w+) -->.*?<!-- /bench:\2 -->\n)", text, flags=re.S)
    return {name: block for block, name in found}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=DEFAULT, help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--loss-tokens", type=int, default=4096)
    ap.add_argument("--onpolicy-cycles", type=int, default=6, help="cycles (of 2 steps) per run in the onpolicy bench")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary work folder (caches, checkpoints)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        ap.error(f"--only: unknown {sorted(only - set(SECTIONS))}; choose from {','.join(SECTIONS)}")
    command = "python -m benchmarks.run" + (f" --only {args.only}" if args.only != DEFAULT else "") + (
        f" --loss-tokens {args.loss_tokens}" if args.loss_tokens != 4096 else "") + (
        f" --onpolicy-cycles {args.onpolicy_cycles}" if args.onpolicy_cycles != 6 else "")
    work = Path(tempfile.mkdtemp(prefix="gkd-bench-"))
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sections = _old_sections(Path(args.out))
    try:
        _measure(only, args, work, sections, command, started)
    finally:
        # A full bench leaves several GB of caches and checkpoints; a user re-running it must not fill the disk.
        if args.keep_work:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(write_benchmarks(Path(args.out), sections))
    return 0


def _measure(only: set[str], args: argparse.Namespace, work: Path, sections: dict[str, str], command: str,
             started: str) -> None:
    """Run the chosen sections in SECTIONS order, each writing its markdown into `sections`."""
    score = None
    if "score" in only or "train" in only:
        from benchmarks import score_bench

        score = score_bench.run(work)
        if "score" in only:
            sections["score"] = _section("score", score_bench.markdown(score), score, command, started)
    if "served" in only:
        from benchmarks import score_bench

        res = score_bench.served_run(work / "served")
        sections["served"] = _section("served", score_bench.served_markdown(res), res, command, started)
    if "loss" in only:
        out = work / "loss.json"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loss_bench.py"), "--tokens", str(args.loss_tokens),
                        "--memory-tokens", f"{args.loss_tokens},16384", "--repeats", "2", "--json", str(out)],
                       check=True, cwd=ROOT)
        from benchmarks import loss_bench

        res = json.loads(out.read_text())
        sections["loss"] = _section("loss", loss_bench.to_markdown(res), res, command, started)
    if "train" in only:
        from benchmarks import train_bench

        res = train_bench.run(score["prose_cache"], work)
        sections["train"] = _section("train", train_bench.markdown(res), res, command, started)
    if "lora" in only:
        from benchmarks import lora_bench

        res = lora_bench.run(work / "lora")
        sections["lora"] = _section("lora", lora_bench.markdown(res), res, command, started)
    if "baselines" in only:
        from benchmarks import baseline_bench

        res = baseline_bench.run(work / "baselines")
        sections["baselines"] = _section("baselines", baseline_bench.markdown(res), res, command, started)
    if "onpolicy" in only:
        from benchmarks import onpolicy_bench

        res = onpolicy_bench.run(work / "onpolicy", cycles=args.onpolicy_cycles)
        sections["onpolicy"] = _section("onpolicy", onpolicy_bench.markdown(res), res, command, started)
    if "opd" in only:
        from benchmarks import onpolicy_bench

        res = onpolicy_bench.run_opd(work / "opd", cycles=args.onpolicy_cycles)
        sections["opd"] = _section("opd", onpolicy_bench.markdown_opd(res), res, command, started)
    if "topp" in only:
        from benchmarks import topp_bench

        res = topp_bench.run(work / "topp")
        sections["topp"] = _section("topp", topp_bench.markdown(res), res, command, started)
    if "faults" in only:
        from benchmarks import faults

        res = faults.run(work / "faults")
        sections["faults"] = _section("faults", faults.markdown(res), res, command, started)


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


if __name__ == "__main__":
    raise SystemExit(main())
