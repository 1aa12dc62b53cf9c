"""No process outlives its command (issue #35), counted: kill -9 of `gkd score`, `gkd generate`, `gkd train` and
`gkd onpolicy` at seeded points, and the processes below each killed command still alive 30 s later.

    python -m benchmarks.run --only lifetime

Each command runs once uninterrupted, watched: its wall time T, and the time P at which the processes below it
first reached their largest number (the engine, its workers, compile and spawn helpers all up). Then it runs
`points` times into a fresh output folder, SIGKILLed after a delay drawn from U(P, 0.9 T): a kill in start-up,
before any child exists, would prove nothing (on a loaded machine the first half of a run can be imports). While
it runs, every process below it is recorded from /proc (pid and start time, so a reused pid is not mistaken for one
of them); after the kill, those still alive 30 s later are its leftovers (then killed, so the next start is not
slowed).
The commands are the faults bench's (benchmarks/faults.py: tiny random models, the real CLI in a subprocess) and a
2-cycle on-policy run of the on-policy tests' size (tests/onpolicy/onpolicy_helpers.py). What keeps the count at
zero is pipeline/lifetime.py (every child watches its parent; a watchdog per command ends what third-party code
starts); whether a rerun after such a kill gives the uninterrupted output is the faults section's measure.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from benchmarks import faults
from pipeline.lifetime import descendants, survivors

COMMANDS = ("score", "generate", "train", "onpolicy")
WAIT_S = 30.0


def _onpolicy(s: dict, out: Path) -> list[str]:
    from onpolicy_helpers import overrides

    values = overrides(s["onpolicy_models"], out)
    return [sys.executable, "-m", "pipeline", "onpolicy", *(f"{k}={'null' if v is None else v}" for k, v in values.items())]


def command(name: str, s: dict, out: Path) -> list[str]:
    return _onpolicy(s, out) if name == "onpolicy" else faults.command(name, s, out)


def kills(name: str, s: dict, work: Path, points: int, seed: int) -> dict:
    """`points` kills of command `name`; the processes seen below it and those left after each."""
    log = work / f"{name}.stderr"
    t0 = time.monotonic()
    ref = faults._start(command(name, s, work / f"{name}-ref"), log)
    peak, peak_s = 0, 0.0
    while ref.poll() is None:
        if (n := len(descendants(ref.pid))) > peak:
            peak, peak_s = n, time.monotonic() - t0
        time.sleep(0.1)
    wall = time.monotonic() - t0
    if ref.wait():
        raise RuntimeError(f"reference {name} run failed (exit {ref.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    rng = random.Random(f"{seed}-{name}")
    per_kill = []
    for i in range(points):
        delay = rng.uniform(min(peak_s, 0.8 * wall), 0.9 * wall)
        proc = faults._start(command(name, s, work / f"{name}-{i}"), log)
        below, until = {}, time.monotonic() + delay
        while proc.poll() is None and time.monotonic() < until:
            below.update(descendants(proc.pid))
            time.sleep(0.1)
        if proc.poll() is not None:  # finished before the kill: not a point (the next draw is another)
            per_kill.append({"delay_s": round(delay, 2), "finished_first": True})
            continue
        below.update(descendants(proc.pid))
        proc.kill()
        proc.wait()
        left = survivors(below, wait_s=WAIT_S)
        per_kill.append({"delay_s": round(delay, 2), "seen": len(below), "left": len(left)})
    killed = [k for k in per_kill if not k.get("finished_first")]
    return {"command": name, "reference_s": round(wall, 1), "peak": peak, "peak_s": round(peak_s, 1), "killed": len(killed),
            "seen": sum(k["seen"] for k in killed), "left": sum(k["left"] for k in killed), "kills": per_kill}


def run(work: Path, points: int = 3, seed: int = 0) -> dict:
    sys.path.insert(0, str(faults.ROOT / "tests" / "onpolicy"))  # onpolicy_helpers: the on-policy tests' run
    from onpolicy_helpers import build_models

    work.mkdir(parents=True, exist_ok=True)
    s = faults.setup(work, rows=24, train_steps=6)
    (work / "op").mkdir()
    s["onpolicy_models"] = build_models(work / "op")
    return {"points": points, "seed": seed, "wait_s": WAIT_S,
            "commands": [kills(name, s, work, points, seed) for name in COMMANDS]}


def markdown(res: dict) -> str:
    rows = res["commands"]
    total = sum(r["left"] for r in rows)
    per = "; ".join(f"{r['command']} {r['left']}" for r in rows)
    detail = "; ".join(f"{r['command']}: {r['killed']} kills at U({r['peak_s']}, 0.9 x {r['reference_s']}) s, at "
                       f"most {r['peak']} processes below it, {r['seen']} seen in all" for r in rows)
    return "\n".join([
        "| measure | result | detail | goal |",
        "|---|---|---|---|",
        f"| processes left after kill -9, per command | **{total}** ({per}) | alive {res['wait_s']:.0f} s after the "
        f"kill, of the processes below the command (/proc); {detail} | 0 |",
    ])
