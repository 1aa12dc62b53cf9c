"""No process outlives its command (issue #35), counted: kill -9 of `gkd score`, `gkd generate`, `gkd train` and
`gkd onpolicy` at seeded points, and the processes below each killed command still alive 30 s later.

    python -m benchmarks.run --only lifetime

Each command runs once uninterrupted, watched: its wall time T, and the largest number of processes below it that
lasted a second (the engine, its workers, loader and spawn helpers up). Then it is started `points` times into a
fresh output folder and SIGKILLed once that many processes are below it, after a seeded extra delay of up to T/4;
a start that ends first is started again, with half the extra delay. A kill timed by the clock alone fell into
start-up on a loaded machine (8 of the 11 kills of a first run saw no child at all). Every process below it is
recorded from /proc while it runs (pid and start time, so a reused pid is not mistaken for one of them); after the
kill, those still alive 30 s later are its leftovers (then killed, so the next start is not slowed).
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
HOLD_S = 1.0
RETRIES = 2


def _onpolicy(s: dict, out: Path) -> list[str]:
    from onpolicy_helpers import overrides

    values = overrides(s["onpolicy_models"], out)
    return [sys.executable, "-m", "pipeline", "onpolicy", *(f"{k}={'null' if v is None else v}" for k, v in values.items())]


def command(name: str, s: dict, out: Path) -> list[str]:
    return _onpolicy(s, out) if name == "onpolicy" else faults.command(name, s, out)


def _reference(name: str, s: dict, work: Path, log: Path) -> tuple[float, int]:
    """One uninterrupted run, watched: its wall time and the largest number of processes below it that lasted at
    least HOLD_S (a compile helper living for an instant is not what a kill should wait for)."""
    t0 = time.monotonic()
    ref = faults._start(command(name, s, work / f"{name}-ref"), log)
    steady, size, since = 0, 0, t0
    while ref.poll() is None:
        n, now = len(descendants(ref.pid)), time.monotonic()
        if n != size:
            size, since = n, now
        elif now - since >= HOLD_S:
            steady = max(steady, n)
        time.sleep(0.1)
    if ref.wait():
        raise RuntimeError(f"reference {name} run failed (exit {ref.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    return time.monotonic() - t0, steady


def kills(name: str, s: dict, work: Path, points: int, seed: int) -> dict:
    """`points` kills of command `name`, each once the processes below it number the reference run's steady
    largest, plus a seeded extra delay; a start that ends first is started again (up to RETRIES times)."""
    log = work / f"{name}.stderr"
    wall, target = _reference(name, s, work, log)
    rng = random.Random(f"{seed}-{name}")
    per_kill, starts = [], 0
    for i in range(points):
        extra = rng.uniform(0.0, 0.25 * wall)
        for attempt in range(RETRIES + 1):
            starts += 1
            t0 = time.monotonic()
            proc = faults._start(command(name, s, work / f"{name}-{i}-{attempt}"), log)
            below, reached = {}, None
            while proc.poll() is None:
                now_below = descendants(proc.pid)
                below.update(now_below)
                if reached is None and len(now_below) >= target:
                    reached = time.monotonic()
                if reached is not None and time.monotonic() - reached >= extra * (0.5 ** attempt):
                    break
                time.sleep(0.1)
            if proc.poll() is None:
                at_kill = len(descendants(proc.pid))
                proc.kill()
                proc.wait()
                left = survivors(below, wait_s=WAIT_S)
                per_kill.append({"after_s": round(time.monotonic() - t0, 1), "at_kill": at_kill, "seen": len(below),
                                 "left": len(left)})
                break
        else:
            per_kill.append({"finished_first": True})
    killed = [k for k in per_kill if not k.get("finished_first")]
    return {"command": name, "reference_s": round(wall, 1), "target": target, "starts": starts, "killed": len(killed),
            "at_kill_max": max((k["at_kill"] for k in killed), default=0), "seen": sum(k["seen"] for k in killed),
            "left": sum(k["left"] for k in killed), "kills": per_kill}


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
    detail = "; ".join(f"{r['command']}: {r['killed']} kills ({r['starts']} starts), each once {r['target']} processes "
                       f"were below it (the uninterrupted run's steady largest; {r['reference_s']} s), at most "
                       f"{r['at_kill_max']} alive at a kill" for r in rows)
    return "\n".join([
        "| measure | result | detail | goal |",
        "|---|---|---|---|",
        f"| processes left after kill -9, per command | **{total}** ({per}) | alive {res['wait_s']:.0f} s after the "
        f"kill, of the processes below the command (/proc); {detail} | 0 |",
    ])
