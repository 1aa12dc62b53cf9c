"""Cache index at scale (issue 33): synthetic caches of many 2-row shards, written with the codec (no teacher).

    python -m benchmarks.run --only index                 # the BENCHMARKS.md section
    python -m benchmarks.index_bench child OUT.json ARGS   # (internal) `gkd train ARGS`, then its peak RSS
    python -m benchmarks.index_bench synth ROOT LO HI SEED # (internal) shards LO..HI-1 of a synthetic cache

Measured: the trainer's time from process start to its first optimizer step and its peak RSS on caches of 1k, 10k
and 100k shards (a tiny random Llama student, one rank, fp32 CPU, the default `verify_checksums`); the loader's
start-up (ScoredLoader construction: index + order) reading the index vs every shard's footer at 10k, interleaved;
and the time of one more committed part (`TeacherCache.add_rows`, fsync on) into the 100k cache vs an empty one,
interleaved.

The caches are the layout a score run leaves (shards, markers, `index.jsonl`), written fast: the product's shard
writer in one process per core on disjoint shard ranges, os.fsync a no-op (durability is not what is measured), no
commit lock (the ranges are disjoint), rows that share their scored completions from a small pool (each with its own
numbered prompt, so its own content key); then the index by the product's `gkd cache index`. Measured on 2 cores:
the 100k cache's shards in 212 s at load 1.5 (732 s at load ~8, the machine shared), its index in 69 s; the whole
section 8 minutes on the quiet machine, 19 on the shared one.
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
SIZES = (1_000, 10_000, 100_000)
LOADER_AT = 10_000  # the footer-reading loader: ~2 ms a shard, 10^5 would be minutes a round


def _tests_helpers() -> None:
    sys.path.insert(0, str(ROOT / "tests"))  # tiny_models, scored_rows: the tests' tiny random models and rows


def student(work: Path) -> Path:
    _tests_helpers()
    from tiny_models import build_llama, build_tokenizer

    tok = build_tokenizer(work)
    return build_llama(work, vocab_size=len(tok), layers=2, hidden=64, heads=2, kv_heads=2)


POOL = 64  # distinct scored completions per writer; each row gets its own prompt, hence its own content key


def synth_cache(root: Path, shards: int, descriptor, seed: int = 0, workers: int | None = None) -> dict[str, float]:
    """A cache of `shards` 2-row shards (rows of 8-40 tokens, 4 prompt tokens), laid out as a score run writes it:
    the shards and their markers by `TeacherCache._write_shard` (the codec, the scored schema, `shards.write_shard`)
    in `workers` processes of disjoint shard ranges, then the index by `gkd cache index` (`rebuild_index`, from
    the shards' footers: the same bytes the writers' appends give, tests/store/test_index.py). Seconds of each."""
    from pipeline.store import TeacherCache

    TeacherCache.create_or_open(root, descriptor)
    workers = workers or max(1, min(len(os.sched_getaffinity(0)), 8))
    bounds = np.linspace(0, shards, workers + 1).astype(int)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.index_bench", "synth", str(root), str(lo), str(hi),
                               str(seed)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo]
    errors = [(p.communicate()[1], p.returncode) for p in procs]
    if any(rc for _, rc in errors):
        raise RuntimeError(f"synthesising {root} failed:\n" + "\n".join(e[-3000:] for e, rc in errors if rc))
    t1 = time.perf_counter()
    index = TeacherCache.open(root).rebuild_index()
    if len(index.names) != shards or len(set(index.keys.tolist())) != 2 * shards:
        raise RuntimeError(f"{root}: {len(index.names)} shards indexed, expected {shards} with unique keys")
    return {"shards_s": t1 - t0, "index_s": time.perf_counter() - t1, "workers": len(procs)}


def _synth_worker(root: Path, lo: int, hi: int, seed: int) -> None:
    """Shards scored-{lo..hi-1}: two rows each, a completion of the pool behind a prompt that numbers the row (4
    base-vocab digits of its index), so every row's content key is unique and computed from its own tokens."""
    _tests_helpers()
    from scored_rows import make_row

    from pipeline.store import TeacherCache
    from pipeline.store.fingerprint import content_key, sample_id

    cache = TeacherCache.open(root)
    d = cache.descriptor
    if d.vocab_size ** 4 < 2 * hi:
        raise ValueError(f"vocab {d.vocab_size}: too small to number {2 * hi} rows with 4 prompt tokens")
    rng = np.random.default_rng([seed, lo])
    pool = [make_row(rng, d, int(rng.integers(8, 40)), 4) for _ in range(POOL)]
    os.fsync = lambda fd: None  # durability is not what is measured; this process writes nothing else
    for i in range(lo, hi):
        rows = []
        for j in (2 * i, 2 * i + 1):
            row = pool[int(rng.integers(POOL))]
            ids = row["input_ids"].copy()
            ids[:4] = [(j // d.vocab_size ** p) % d.vocab_size for p in range(4)]
            rows.append({**row, "input_ids": ids,
                         "key": content_key(d.teacher_fingerprint, ids, 4, d.k, d.logprob_mode),
                         "sample_id": sample_id("p", ids[:4], ids[4:])})
        # the shard and its marker exactly as `write_shard` commits them, less the commit lock and the index line:
        # the processes write disjoint names, and the index is built once at the end (`synth_cache`)
        cache._write_shard(f"scored-{i:06d}", rows)


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
    from pipeline.train.data.loader import ScoredLoader

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


def run(work: Path, rounds: int = 2, commits: int = 15, sizes: tuple[int, ...] = SIZES) -> dict:
    from pipeline.store import Descriptor
    from pipeline.store.fingerprint import tokenizer_fingerprint

    work.mkdir(parents=True, exist_ok=True)
    student_dir = student(work / "student")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(student_dir))
    d = Descriptor(teacher_fingerprint="t" * 32, tokenizer_fingerprint=tokenizer_fingerprint(student_dir), k=8,
                   logprob_mode="raw_logprobs", vocab_size=vocab)
    res: dict = {"sizes": list(sizes), "synthesis": {}, "train": {n: [] for n in sizes}, "loader": {}}
    for n in sizes:
        res["synthesis"][n] = synth_cache(work / f"cache-{n}", n, d)
    for r in range(rounds):  # interleaved: the machine is shared
        for n in sizes:
            res["train"][n].append(_first_step(student_dir, work / f"cache-{n}", work / f"run-{n}-{r}"))
    mid = work / f"cache-{LOADER_AT if LOADER_AT in sizes else sizes[-1]}"
    pairs = [(_loader_start(mid, True), _loader_start(mid, False)) for _ in range(rounds)]
    res["loader"] = {"shards": int(mid.name.split("-")[1]), "index_s": [a for a, _ in pairs],
                     "footers_s": [b for _, b in pairs]}
    res["commit_s"] = _commit_times(work / f"cache-{sizes[-1]}", work / "cache-empty", d, commits)
    res["load"] = os.getloadavg()
    return res


def _k(n) -> str:
    return f"{int(n) // 1000}k"


def markdown(res: dict) -> str:
    sizes = [int(n) for n in res["sizes"]]
    small, large = sizes[0], sizes[-1]
    med = statistics.median

    def at(table: dict, n: int):  # the raw results' keys are strings once read back from BENCHMARKS.md
        return table[str(n)] if str(n) in table else table[n]

    def first(n: int) -> float:
        return med(r["first_step_s"] for r in at(res["train"], n))

    def rss(n: int) -> float:
        return med(r["maxrss_mib"] for r in at(res["train"], n))

    idx, foot = med(res["loader"]["index_s"]), med(res["loader"]["footers_s"])
    big_c, empty_c = med(res["commit_s"]["big"]) * 1e3, med(res["commit_s"]["empty"]) * 1e3
    synth = {n: at(res["synthesis"], n) for n in sizes}
    others = ", ".join(f"{_k(n)}: {first(n):.1f} s" for n in reversed(sizes[:-1]))
    return "\n".join([
        "| measure | value | goal |", "|---|---|---|",
        f"| time to first step, 100k-shard cache | {first(large):.1f} s at {_k(large)} shards ({others}) | ≤ 30 s |",
        f"| loader start-up, index vs footers, 10k shards | {idx / foot:.3f}× ({idx:.2f} s vs {foot:.2f} s"
        f"{'' if res['loader']['shards'] == 10_000 else ', at ' + _k(res['loader']['shards'])}) | ≤ 0.1× |",
        f"| trainer RSS, 100k vs 1k shards | {rss(large) / rss(small):.3f}× ({_k(large)}: {rss(large):.0f} MiB, "
        f"{_k(small)}: {rss(small):.0f} MiB peak) | ≤ 1.2× |",
        f"| score part commit time, 100k vs empty cache | {big_c / empty_c:.2f}× ({_k(large)}: {big_c:.1f} ms, "
        f"empty: {empty_c:.1f} ms, median of {len(res['commit_s']['big'])}) | ≤ 1.5× |",
        "",
        f"Measured at real caches of {', '.join(_k(n) for n in sizes)} shards of 2 rows (8-40 tokens, k=8), "
        "synthesised without a teacher in the layout a score run leaves: the shards and their markers by the "
        f"product's shard writer (the codec, `TeacherCache._write_shard`) in {synth[large]['workers']} processes "
        "of disjoint shard ranges with fsync off, then `index.jsonl` by `gkd cache index` (the product's rebuild "
        "from the footers); the trainer opens them as a user's. Writing took "
        + ", ".join(f"{synth[n]['shards_s']:.0f} s + {synth[n]['index_s']:.0f} s of index ({_k(n)})" for n in sizes)
        + ". Time to first step: from launching `gkd train` (one rank, a tiny random Llama student, fp32 CPU, "
        "default `verify_checksums`) to its first metrics line, median of "
        f"{len(at(res['train'], large))} runs, the sizes interleaved; RSS: the process's peak (ru_maxrss). Loader "
        "start-up: ScoredLoader construction plus its first packing plan, index vs every footer "
        "(`verify_checksums=false`; with the index, checksums are checked where a shard is first read, off the "
        "start-up path), interleaved in one process (warm page cache: the caches were just written). Commit: one "
        f"more 2-row part by `add_rows` (fsync on) into the {_k(large)} cache and into an empty one, alternating, "
        "each writer's first (index-reading) commit untimed. Load average at the end: "
        f"{', '.join(f'{x:.1f}' for x in res['load'])}.",
    ])


def _child(out: str, argv: list[str]) -> int:
    from pipeline.cli import main

    rc = main(["train", *argv])
    Path(out).write_text(json.dumps({"rc": rc, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
    return rc


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        raise SystemExit(_child(sys.argv[2], sys.argv[3:]))
    if sys.argv[1:2] == ["synth"]:
        raise SystemExit(_synth_worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
    print(markdown(run(Path(sys.argv[1]))))
