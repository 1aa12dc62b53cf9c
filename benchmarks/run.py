"""`make bench`: every benchmark side by side, written to BENCHMARKS.md (the command is recorded in the file).

    python -m benchmarks.run [--only score,scorework,served,interop,loss,train,hf,lora,baselines,onpolicy,overlap,overlapkills,faults,lifetime,images,distopt,index,cp,pp,xtok,exact] [--loss-tokens 4096]

Each number is measured in this run on this machine; ratios compare variants run in the same process, interleaved,
because the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import (
    baseline_bench,
    cp_bench,
    distopt_bench,
    exact_bench,
    faults,
    hf_bench,
    image_bench,
    index_bench,
    interop_bench,
    lifetime_bench,
    lora_bench,
    loss_bench,
    onpolicy_bench,
    overlap_bench,
    overlap_kills,
    pp_bench,
    ray_bench,
    score_bench,
    scorework_bench,
    topp_bench,
    train_bench,
    xtok_bench,
)
from benchmarks.report import SECTIONS, Stamp, old_sections, section, stored_raw, write_benchmarks

ROOT = Path(__file__).resolve().parents[1]


DEFAULT = "score,scorework,served,interop,loss,train,hf,lora,baselines,topp,images,distopt,index,cp,pp,xtok,exact"  # onpolicy and opd run whole on-policy runs (~1 h on 2 cores), overlap eighteen (~2.5 h), overlapkills 19 on three executors (~60 min), faults
# (`make faults`) ~20 kills of three commands and the fault tests: ask for them


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=DEFAULT, help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--loss-tokens", type=int, default=4096)
    ap.add_argument("--onpolicy-cycles", type=int, default=6, help="cycles (of 2 steps) per run in the onpolicy bench")
    for name, (module, _, sizes) in PARTED.items():
        ap.add_argument(f"--{name}-parts", default=",".join(module.PARTS),
                        help=f"with --only {name}: re-measure these parts of the {name} section ({sizes} on 2 cores); "
                             "a part left out keeps its stored raw results and says when they were measured")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary work folder (caches, checkpoints)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        ap.error(f"--only: unknown {sorted(only - set(SECTIONS))}; choose from {','.join(SECTIONS)}")
    command = "python -m benchmarks.run" + (f" --only {args.only}" if args.only != DEFAULT else "") + (
        f" --loss-tokens {args.loss_tokens}" if args.loss_tokens != 4096 else "") + (
        f" --onpolicy-cycles {args.onpolicy_cycles}" if args.onpolicy_cycles != 6 else "")
    for name, (module, _, _) in PARTED.items():
        chosen = getattr(args, f"{name}_parts")
        if chosen != ",".join(module.PARTS):
            command += f" --{name}-parts {chosen}"
        if set(chosen.split(",")) - set(module.PARTS) or not chosen:
            ap.error(f"--{name}-parts: choose from {','.join(module.PARTS)}, got {chosen!r}")
    out = Path(args.out)
    sections = old_sections(out)
    work = Path(tempfile.mkdtemp(prefix="gkd-bench-"))
    results: dict[str, dict] = {}  # the score section's caches feed the train section
    text = ""
    try:
        for name in SECTIONS:
            if name not in only:
                continue
            stamp = Stamp.now(command)  # the machine's load before this section, not after it
            res, body = _measure(name, args, work, results, sections)
            sections[name] = section(name, body, res, stamp)
            text = write_benchmarks(out, sections)  # after each section: a later failure keeps what was measured
    finally:
        # A full bench leaves several GB of caches and checkpoints; a user re-running it must not fill the disk.
        if args.keep_work:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(text)
    return 0


# Sections that run in a folder of their own: name -> (run(work), markdown(results)).
SIMPLE = {
    "served": (score_bench.served_run, score_bench.served_markdown),
    "interop": (interop_bench.run, interop_bench.markdown),
    "scorework": (scorework_bench.run, scorework_bench.markdown),
    "hf": (lambda work: hf_bench.run(), lambda res: "\n".join(["| measure | value | goal |", "|---|---|---|",
                                                                *hf_bench.markdown(res)])),
    "lora": (lora_bench.run, lora_bench.markdown),
    "baselines": (baseline_bench.run, baseline_bench.markdown),
    "topp": (topp_bench.run, topp_bench.markdown),
    "faults": (faults.run, faults.markdown),
    "lifetime": (lifetime_bench.run, lifetime_bench.markdown),  # 12 kills, 30 s apiece, and a 2-cycle on-policy run
    "distopt": (distopt_bench.run, distopt_bench.markdown),
    "images": (image_bench.run, image_bench.markdown),
    "index": (index_bench.run, index_bench.markdown),
    "cp": (cp_bench.run, cp_bench.markdown),
    "pp": (pp_bench.run, pp_bench.markdown),
    "xtok": (xtok_bench.run, xtok_bench.markdown),
    "exact": (exact_bench.run, exact_bench.markdown),
}
# Sections measured in parts (`--NAME-parts`; a part left out keeps its stored raw results): name -> (module with
# PARTS, markdown, run(work, args, parts, kept)) and how long each part takes.
PARTED = {
    "ray": (ray_bench, lambda w, a, parts, kept: ray_bench.run(w, a.onpolicy_cycles, parts=parts, kept=kept),
            "onpolicy ~50 min, kills ~25 min"),
    "overlap": (overlap_bench, lambda w, a, parts, kept: overlap_bench.run(w, parts=parts, kept=kept),
                "schedule ~20 min, quality ~20 min, opd ~30 min, seeds ~40 min, lr ~40 min"),
    # 11 kills of 2-cycle overlapped runs on the local executor, 4 on Ray, 4 on Slurm
    "overlapkills": (overlap_kills, lambda w, a, parts, kept: overlap_kills.run(w, parts=parts, kept=kept),
                     "local ~25 min, ray ~10 min, slurm ~25 min"),
}


def _measure(name: str, args: argparse.Namespace, work: Path, results: dict[str, dict],
             sections: dict[str, str]) -> tuple[dict, str]:
    """Run one section; returns its raw results and its markdown."""
    if name in PARTED:
        module, measure, _ = PARTED[name]
        parts = [p for p in module.PARTS if p in getattr(args, f"{name}_parts").split(",")]
        kept = {} if len(parts) == len(module.PARTS) else stored_raw(sections.get(name, ""))
        res = measure(work / name, args, parts, kept)
        return res, module.markdown(res)
    if name in SIMPLE:
        run, markdown = SIMPLE[name]
        res = run(work / name)
        return res, markdown(res)
    if name == "score" or (name == "train" and "score" not in results):
        results["score"] = score_bench.run(work)
    if name == "score":
        return results["score"], score_bench.markdown(results["score"])
    if name == "train":
        res = train_bench.run(results["score"]["prose_cache"], work)
        return res, train_bench.markdown(res)
    if name == "loss":
        out = work / "loss.json"
        # A process of its own: its peak-memory figures must not include the other sections' allocations.
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loss_bench.py"), "--tokens", str(args.loss_tokens),
                        "--memory-tokens", f"{args.loss_tokens},16384", "--repeats", "2", "--json", str(out)],
                       check=True, cwd=ROOT)
        res = json.loads(out.read_text())
        return res, loss_bench.to_markdown(res)
    if name in ("onpolicy", "opd"):
        run = onpolicy_bench.run if name == "onpolicy" else onpolicy_bench.run_opd
        res = run(work / name, cycles=args.onpolicy_cycles)
        return res, (onpolicy_bench.markdown if name == "onpolicy" else onpolicy_bench.markdown_opd)(res)
    raise ValueError(f"no such section: {name}")


if __name__ == "__main__":
    raise SystemExit(main())
