"""Cache index at scale (issue 33): synthetic caches of many 2-row shards, written with the codec (no teacher).

    python -m benchmarks.run --only index                 # the BENCHMARKS.md section
    python -m benchmarks.index_bench child OUT.json ARGS   # (internal) `gkd train ARGS`, then its peak RSS

Measured: the trainer's time from process start to its first optimizer step and its peak RSS on caches of 1k and
10k shards (a tiny random Llama student, one rank, fp32 CPU, the default `verify_checksums`); the loader's start-up
(ScoredLoader construction: index + order) reading the index vs every shard's footer, interleaved; and the time of
one more committed part (`TeacherCache.add_rows`, fsync on) into the big cache vs an empty one, interleaved.

The shards are synthesised with os.fsync a no-op (durability is not what is measured; 5 fsyncs per shard would make
the 10k cache take minutes more). 100k shards are not written here: at the measured ~10-20 ms per shard on this
2-core machine that alone is 17-35 minutes, beyond a bench section's few minutes; the rows give 1k and 10k and the
per-shard slope, from which the 100k figure is extrapolated (labelled so).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1_000, 10_000)


def _tests_helpers() -> None:
    sys.path.insert(0, str(ROOT / "tests"))  # tiny_models, scored_rows: the tests' tiny random models and rows


def student(work: Path) -> Path:
    _tests_helpers()
    from tiny_models import build_llama, build_tokenizer

    tok = build_tokenizer(work)
    return build_llama(work, vocab_size=len(tok), layers=2, hidden=64, heads=2, kv_heads=2)


def synth_cache(root: Path, shards: int, descriptor, seed: int = 0) -> float:
    """A cache of `shards` 2-row shards (rows of 8-40 tokens) through TeacherCache.write_shard; seconds taken."""
    _tests_helpers()
    from scored_rows import make_row

    from pipeline.store import TeacherCache

    cache = TeacherCache.create_or_open(root, descriptor)
    rng = np.random.default_rng(seed)
    real_fsync, t0 = os.fsync, time.perf_counter()
    os.fsync = lambda fd: None
    try:
        for i in range(shards):
            cache.write_shard(f"scored-{i:06d}", [make_row(rng, descriptor, int(rng.integers(8, 40)), 4)
                                                  for _ in range(2)])
    finally:
        os.fsync = real_fsync
    return time.perf_counter() - t0


def _first_step(student_dir: Path, cache: Path, save: Path) -> dict:
    """`gkd train` of one step in a fresh process: seconds from launch to its first metrics line, and peak RSS."""
    out = save.with_suffix(".json")
    args = [f"student={student_dir}", f"cache=[{cache}]", "micro_batch_size=2", "global_batch_size=2",
            "seq_length=64", "train_steps=1", "warmup_steps=0", f"save_dir={save}", "save_interval=1",
            "progress=false"]
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "benchmarks.index_bench", "child", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"gkd train on {cache} failed:\n{done.stderr[-3000:]}")
    res = json.loads(out.read_text())
    return {"first_step_s": (save / "metrics.jsonl").stat().st_mtime - t0, "process_s": time.time() - t0,
            "maxrss_mib": res["maxrss_kib"] / 1024}


def _loader_start(cache: Path, use_index: bool) -> float:
    from pipeline.train.data import ScoredLoader

    t0 = time.perf_counter()
    loader = ScoredLoader([cache], micro_batch_size=2, seq_length=64, seed=0, packing=True, use_index=use_index,
                          verify_checksums=False)  # what the index replaces; checksums are the same work either way
    loader.plan(0)
    return time.perf_counter() - t0


def _commit_times(big: Path, empty: Path, descriptor, rounds: int) -> dict[str, list[float]]:
    """One more 2-row part into each cache, alternating, fsync on; each writer a fresh TeacherCache whose first
    commit (reading the index once) is not timed: a score task commits many parts, the question is their cost."""
    _tests_helpers()
    from scored_rows import make_row

    from pipeline.store import TeacherCache

    rng = np.random.default_rng(7)
    caches = {"big": TeacherCache.open(big), "empty": TeacherCache.create_or_open(empty, descriptor)}
    for c in caches.values():
        c.add_rows("warm-up", [make_row(rng, descriptor, 20, 4) for _ in range(2)])
    times: dict[str, list[float]] = {"big": [], "empty": []}
    for i in range(rounds):
        for name, c in caches.items():
            rows = [make_row(rng, descriptor, 20, 4) for _ in range(2)]
            t0 = time.perf_counter()
            c.add_rows(f"part-{i:04d}", rows)
            times[name].append(time.perf_counter() - t0)
    return times


def run(work: Path, rounds: int = 2, commits: int = 15, sizes: tuple[int, int] = SIZES) -> dict:
    from pipeline.store import Descriptor
    from pipeline.store.fingerprint import tokenizer_fingerprint

    work.mkdir(parents=True, exist_ok=True)
    student_dir = student(work / "student")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(student_dir))
    d = Descriptor(teacher_fingerprint="t" * 32, tokenizer_fingerprint=tokenizer_fingerprint(student_dir), k=8,
                   logprob_mode="raw_logprobs", vocab_size=vocab)
    res: dict = {"sizes": list(sizes), "synthesis_s": {}, "train": {}, "loader": {}}
    for n in sizes:
        res["synthesis_s"][n] = synth_cache(work / f"cache-{n}", n, d)
    for n in sizes:  # interleaved: the machine is shared
        res["train"][n] = [_first_step(student_dir, work / f"cache-{n}", work / f"run-{n}-{r}") for r in range(rounds)]
    big = work / f"cache-{sizes[-1]}"
    pairs = [(_loader_start(big, True), _loader_start(big, False)) for _ in range(rounds)]
    res["loader"] = {"index_s": [a for a, _ in pairs], "footers_s": [b for _, b in pairs]}
    res["commit_s"] = _commit_times(big, work / "cache-empty", d, commits)
    res["load"] = os.getloadavg()
    return res


def markdown(res: dict) -> str:
    small, large = (str(n) if str(n) in res["train"] else n for n in res["sizes"])
    med = statistics.median

    def first(n) -> float:
        return med(r["first_step_s"] for r in res["train"][n])

    def rss(n) -> float:
        return med(r["maxrss_mib"] for r in res["train"][n])

    idx, foot = med(res["loader"]["index_s"]), med(res["loader"]["footers_s"])
    # What grows with the cache in the time to first step is the loader's start-up (the rest: imports, the model,
    # the first step); the 100k figure adds 90k shards at the index loader's measured per-shard start-up cost.
    per_shard = idx / int(large)
    at_100k = first(large) + per_shard * (100_000 - int(large))
    big_c, empty_c = med(res["commit_s"]["big"]) * 1e3, med(res["commit_s"]["empty"]) * 1e3
    synth = {n: res["synthesis_s"][n] / int(n) * 1e3 for n in res["synthesis_s"]}
    return "\n".join([
        "| measure | value | goal |", "|---|---|---|",
        f"| time to first step, 100k-shard cache | {first(large):.1f} s at {int(large) // 1000}k shards, "
        f"{first(small):.1f} s at {int(small) // 1000}k; 100k not written here (see below): extrapolated "
        f"{at_100k:.1f} s (+{per_shard * 1e3:.3f} ms of index start-up per shard) | ≤ 30 s |",
        f"| loader start-up, index vs footers, 10k shards | {idx / foot:.3f}× ({idx:.2f} s vs {foot:.2f} s) | ≤ 0.1× |",
        f"| trainer RSS, 100k vs 1k shards | {rss(large) / rss(small):.3f}× at {int(large) // 1000}k vs "
        f"{int(small) // 1000}k ({rss(large):.0f} vs {rss(small):.0f} MiB peak) | ≤ 1.2× |",
        f"| score part commit time, 100k vs empty cache | {big_c / empty_c:.2f}× at {int(large) // 1000}k shards "
        f"({big_c:.1f} ms vs {empty_c:.1f} ms, median of {len(res['commit_s']['big'])}) | ≤ 1.5× |",
        "",
        f"Synthetic caches of 2-row shards written by the codec (no teacher), {', '.join(f'{int(n) // 1000}k' for n in res['sizes'])} "
        f"shards, at {', '.join(f'{v:.1f}' for v in synth.values())} ms per shard with fsync off: a 100k cache would "
        "take ~100k × that here, beyond a bench section's few minutes, so the 100k figures are measured at 10k; the "
        "time to first step at 100k is the 10k one plus 90k × the index loader's start-up per shard (the part of start-up "
        "that grows with the cache; whole-process runs on a shared machine vary by more than that between 1k and 10k). "
        "Time to first step: from launching `gkd train` (one rank, a tiny random Llama student, "
        "fp32 CPU, default `verify_checksums`) to its first metrics line, median of "
        f"{len(res['train'][large])} interleaved runs; RSS: the process's peak (ru_maxrss). Loader start-up: "
        "ScoredLoader construction plus its first packing plan, index vs every footer (`verify_checksums=false`; with "
        "the index, checksums are checked where a shard is first read, off the start-up path), interleaved in one process "
        f"(warm page cache). Commit: one more 2-row part by `add_rows` (fsync on) into the {int(large) // 1000}k "
        "cache and into an empty one, alternating, each writer's first (index-reading) commit untimed. Load average "
        f"at the end: {', '.join(f'{x:.1f}' for x in res['load'])}.",
    ])


def _child(out: str, argv: list[str]) -> int:
    from pipeline.cli import main

    rc = main(["train", *argv])
    Path(out).write_text(json.dumps({"rc": rc, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
    return rc


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        raise SystemExit(_child(sys.argv[2], sys.argv[3:]))
    print(markdown(run(Path(sys.argv[1]))))
