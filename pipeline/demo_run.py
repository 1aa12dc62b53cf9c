"""`make demo`: the whole offline pipeline on a real pretrained teacher, on a CPU, with a report and a picture.

The entry of `gkd demo` (`python -m pipeline.demo_run`): its arguments and the summary it prints; the demo itself is
pipeline/demo.py `run`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeline.demo import QUICK, DemoConfig, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gkd demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a reduced run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = DemoConfig(**(QUICK if args.quick else {}))
    if args.out:
        cfg.out = args.out
    t = time.perf_counter()
    r = run(cfg)
    print(f"\n[demo] held-out KL(teacher‖student): {r['heldout_kl_before']:.3f} → {r['heldout_kl_after']:.3f} nats "
          f"({100 * (r['kl_reduction'] or 0):.0f} % lower); NLL of teacher answers "
          f"{r['heldout_nll_teacher_answers_before']:.3f} → {r['heldout_nll_teacher_answers_after']:.3f}")
    print(f"[demo] cache: {r['cache']['samples']} samples, {r['cache']['scored_tokens']} scored tokens, "
          f"{r['cache_bytes_per_token']} B/token; second student run: {r['teacher_forwards_second_run']} teacher forwards")
    be = r["break_even"]
    print(f"[demo] top-1 agreement with the teacher: {100 * r['top1_agreement_before']:.1f} % → "
          f"{100 * r['top1_agreement_after']:.1f} %; {r['task_accuracy']['note']}")
    print(f"[demo] break-even: {be['student_runs_to_break_even']} student runs (teacher pass {be['teacher_pass_seconds']} s; "
          f"a step {be['live_teacher_step_seconds']} s with a live teacher vs {be['cached_step_seconds']} s from the "
          f"cache); stage seconds {r['seconds']}")
    print(f"[demo] total {time.perf_counter() - t:.0f} s. Report: {Path(cfg.out) / 'report.json'}, picture: "
          f"{Path(cfg.out) / 'report.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
