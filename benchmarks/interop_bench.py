"""`gkd cache export` and `gkd cache import` against scoring, on the embedded-default teacher's rows.

    python -m benchmarks.run --only interop

SmolLM2-135M-Instruct (fp32, vLLM CPU) scores prose rollouts at k=64 with the default codec (the engine opened
once, outside the timings); then, per round, the cache is exported to plain Parquet (rows = scored positions) and
that export imported (`--from plain`) into a fresh cache. "import vs score" compares the import's whole wall
time with the score run's whole wall time over the same rows (engine start excluded, row selection, scoring,
encoding and writes included): what a user saves by importing teacher rows they already have instead of rescoring.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.score_bench import K, prose_rows
from pipeline.assets import teacher_dir
from pipeline.engine import EngineArgs, open_engine
from pipeline.score.config import ScoreConfig
from pipeline.score.scorer import score
from pipeline.store import TeacherCache, read_cache
from pipeline.store.export import export_plain
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.imports import ImportRequest, import_rows
from pipeline.store.rollouts import write_rollouts


def run(work: Path | None = None, prose_tokens: int = 4_000, rounds: int = 2) -> dict:
    from transformers import AutoTokenizer

    teacher = teacher_dir()
    tok = AutoTokenizer.from_pretrained(teacher)
    work = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix="gkd-bench-interop-"))
    rows, source = prose_rows(tok, prose_tokens)
    write_rollouts(work / "rollouts" / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint=tokenizer_fingerprint(tok))
    base = dict(rollouts=str(work / "rollouts"), teacher=str(teacher), topk=K, max_model_len=2048, batch_tokens=4096,
                part_rows=8)
    times: dict[str, list[float]] = {"score": [], "export": [], "import": []}
    positions = 0
    with open_engine(EngineArgs(model=str(teacher), dtype="float32", max_model_len=2049, kv_cache_gib=1.0,
                                max_num_batched_tokens=4096), max_logprobs=K, logprobs_mode="raw_logprobs") as llm:
        for rnd in range(rounds):
            t = time.perf_counter()
            score(ScoreConfig(**base, cache=str(work / f"scored-{rnd}")), llm=llm)
            times["score"].append(time.perf_counter() - t)
            t = time.perf_counter()
            res = export_plain(work / f"scored-{rnd}", work / f"plain-{rnd}")
            times["export"].append(time.perf_counter() - t)
            positions = res["positions"]
            t = time.perf_counter()
            imp = import_rows(ImportRequest(fmt="plain", source=work / f"plain-{rnd}", rollouts=work / "rollouts",
                                            cache=work / f"imported-{rnd}"))
            times["import"].append(time.perf_counter() - t)
    same = {s.key for s in read_cache(work / "scored-0")} == {s.key for s in read_cache(work / "imported-0")}
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = sum(p.stat().st_size for p in (work / "plain-0").glob("*.parquet"))
    cache_bytes = TeacherCache.open(work / "scored-0").stats()["bytes"]
    return {"teacher": "SmolLM2-135M-Instruct (fp32, vLLM CPU)", "k": K, "prose_source": source, "rounds": rounds,
            "samples": len(rows), "positions": positions, "imported_rows": imp["rows"], "same_keys": same,
            "export_rows_s": positions / med["export"], "import_positions_s": positions / med["import"],
            "score_s": med["score"], "import_s": med["import"], "export_s": med["export"],
            "import_vs_score": med["import"] / med["score"], "export_bytes_per_position": nbytes / positions,
            "cache_bytes_per_position": cache_bytes / positions, "seconds": times}


def markdown(res: dict) -> str:
    return "\n".join([
        f"Teacher: {res['teacher']}, k={res['k']}, {res['samples']} prose rollouts ({res['prose_source']}), "
        f"{res['positions']} scored positions; median of {res['rounds']} rounds, each: `gkd score` (engine already "
        "open), `gkd cache export` of that cache, `gkd cache import --from plain` of the export into a fresh cache "
        f"(same keys as the scored cache: {res['same_keys']}).",
        "",
        "| measurement | value | detail | goal |",
        "|---|---|---|---|",
        f"| cache export rows/s | **{res['export_rows_s']:.0f}** | {res['positions']} rows (one per scored position) "
        f"in {res['export_s']:.2f} s; {res['export_bytes_per_position']:.0f} B/row plain Parquet vs "
        f"{res['cache_bytes_per_position']:.0f} B/position in the cache | report |",
        f"| cache import vs score time | **{res['import_vs_score']:.3f}×** | import {res['import_s']:.2f} s "
        f"({res['import_positions_s']:.0f} positions/s, two passes: check, then write) vs score "
        f"{res['score_s']:.1f} s | report |",
    ])
