"""`gkd`: one sub-command per stage, each handing its arguments to one plain function.

    gkd cache stats DIR        what a teacher cache holds (samples, tokens, bytes/token, fingerprints)
    gkd cache verify DIR       checksums, schema, descriptor; exits 1 naming every bad file
    gkd cache export DIR --out OUT                      the cache as plain Parquet, one row per scored position
    gkd cache import --from plain|distillkit|megatron --in SRC --rollouts R --cache C [--teacher MODEL_DIR]
    gkd cache index DIR        rewrite the cache's shard index from the shards (pipeline/store/index.py)
    gkd fingerprint MODEL      a teacher's fingerprint; warms the fingerprint record (pipeline/store/weights.py)
    gkd score ...              rollouts -> teacher top-k rows in the cache (pipeline/score)
    gkd generate ...           prompts -> student rollouts (pipeline/generate)
    gkd import ...             dataset responses -> off-policy rollouts (pipeline/generate)
    gkd train ...              a student (Megatron-Core or transformers) on the cache (pipeline/train)

Stage modules are imported only when their command runs, so `gkd cache ...` starts without torch or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path

from pipeline import lifetime, logs
from pipeline.errors import command as refusals_to_messages
from pipeline.store import TeacherCache
from pipeline.store.export import export_plain
from pipeline.store.fingerprint import FINGERPRINT_SCHEME, teacher_fingerprint_info
from pipeline.store.imports import FORMATS, ImportRequest, import_rows
from pipeline.store.weights import RECORD_ENV

# command -> (module with a `main(argv) -> int`, one-line help); a module is imported only when its command runs.
STAGES: dict[str, tuple[str, str]] = {
    "score": ("pipeline.score.run", "score rollouts with a vLLM teacher into a cache"),
    "generate": ("pipeline.generate.run", "sample student rollouts with vLLM"),
    "import": ("pipeline.generate.import_run", "turn dataset responses into off-policy rollouts"),
    "train": ("pipeline.train.run", "train a student (Megatron-Core or transformers) on a teacher cache"),
    "export": ("pipeline.train.export_run", "export a trained student to a Hugging Face folder"),
    "onpolicy": ("pipeline.onpolicy.run", "alternate generate -> score -> train"),
    "slurm": ("pipeline.slurm.cli", "submit stages as Slurm jobs"),
    "ray": ("pipeline.ray.cli", "run stages as Ray tasks on a Ray cluster"),
    "demo": ("pipeline.demo_run", "the whole pipeline on the embedded default, with a report"),
}


@refusals_to_messages("gkd cache")
def cache_main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="gkd cache", description="Inspect a teacher cache.")
    sub = parser.add_subparsers(dest="action", required=True)
    p_stats = sub.add_parser("stats", help="samples, scored tokens, shards, bytes/token, k, fingerprints")
    p_stats.add_argument("dir")
    p_stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_verify = sub.add_parser("verify", help="checksums, schema, descriptor, codec; non-zero exit on any problem")
    p_verify.add_argument("dir")
    p_verify.add_argument("--no-decode", action="store_true", help="skip decoding every row (faster)")
    p_export = sub.add_parser("export", help="plain Parquet for any tool: one row per scored position")
    p_export.add_argument("dir")
    p_export.add_argument("--out", required=True, help="a new folder for the part-NNNNN.parquet files")
    p_export.add_argument("--format", default="parquet", choices=["parquet"])
    p_import = sub.add_parser("import", help="another tool's top-k teacher output into a cache (keyed by content)")
    p_import.add_argument("--from", dest="fmt", required=True, choices=FORMATS)
    p_import.add_argument("--in", dest="source", required=True, help="the file or folder to import")
    p_import.add_argument("--rollouts", required=True, help="the rollouts those rows were scored on")
    p_import.add_argument("--cache", required=True, help="the cache to create or grow")
    p_import.add_argument("--teacher", help="the teacher's model folder (its fingerprint and vocabulary size)")
    p_import.add_argument("--teacher-fingerprint", help="the teacher's fingerprint, without its folder")
    p_import.add_argument("--vocab-size", type=int, help="the teacher's vocabulary size (megatron, without --teacher)")
    p_import.add_argument("--codec", help="the cache's codec (default: the export's, else the default codec)")
    p_import.add_argument("--score-prompt", action="store_true", help="store prompt positions too (as gkd score "
                          "--score-prompt)")
    p_index = sub.add_parser("index", help="rewrite the shard index (index.jsonl) from the shards' footers")
    p_index.add_argument("dir")
    args = parser.parse_args(argv)
    if args.action in ("export", "import"):
        return _export(args) if args.action == "export" else _import(args)
    cache = TeacherCache.open(args.dir)
    if args.action == "index":
        idx = cache.rebuild_index()
        print(f"gkd cache index: {len(idx.names)} shards, {len(idx.keys)} rows indexed in {idx.path}")
        return 0
    if args.action == "stats":
        stats = cache.stats()
        if args.json:
            print(json.dumps(stats, indent=1))
        else:
            width = max(map(len, stats))
            for name, value in stats.items():
                print(f"{name:<{width}}  {value}")
        return 0
    problems = cache.verify(decode=not args.no_decode)
    for p in problems:
        print(f"BAD  {p}", file=sys.stderr)
    n = len(cache.shard_paths())
    if problems:
        print(f"gkd cache verify: {len(problems)} problem(s) in {args.dir} ({n} complete shards)", file=sys.stderr)
        return 1
    print(f"gkd cache verify: OK, {n} shards in {args.dir}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    total = TeacherCache.open(args.dir).stats()["scored_tokens"]
    with tqdm(total=total, unit="pos", unit_scale=True, desc="export", file=sys.stderr) as bar:
        res = export_plain(args.dir, args.out, progress=bar.update)
    print(f"gkd cache export: {res['samples']} samples, {res['positions']} positions in {res['files']} file(s) "
          f"-> {res['out']}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    req = ImportRequest(fmt=args.fmt, source=Path(args.source), rollouts=Path(args.rollouts), cache=Path(args.cache),
                        teacher=Path(args.teacher) if args.teacher else None,
                        teacher_fingerprint=args.teacher_fingerprint, vocab_size=args.vocab_size, codec=args.codec,
                        score_prompt=args.score_prompt)
    # delay: the checks before writing take a moment; a refusal then prints its message and no empty bar
    with tqdm(unit="pos", unit_scale=True, desc=f"import {args.fmt}", file=sys.stderr, delay=2.0) as bar:
        res = import_rows(req, progress=bar.update)
    print(f"gkd cache import: {res['rows']} rows ({res['positions']} positions) from {args.source}: "
          f"{res['written']} written, {res['already_cached']} already cached, {res['rollouts_without_rows']} "
          f"rollout(s) without a row, {res['actual_outside_topk_rows']} row(s) with the actual token outside the "
          f"top-k (logprob bound) -> {res['cache']}")
    return 0


@refusals_to_messages("gkd fingerprint")
def fingerprint_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gkd fingerprint",
        description="Print a teacher model folder's fingerprint (what `gkd score` writes to cache.json), hashing only "
        "the weight files the fingerprint record has not seen in their current state. Run it once before a Slurm or "
        "Ray array of score tasks: every task then reads the record instead of the weights.")
    parser.add_argument("model", help="a Hugging Face model folder (config.json + weight files)")
    parser.add_argument("--cache", help="compute it the way this existing cache's fingerprint was (its scheme)")
    parser.add_argument("--rehash", action="store_true", help="ignore the record and read every byte again")
    parser.add_argument("--json", action="store_true", help="print JSON: fingerprint, scheme, files hashed/reused")
    args = parser.parse_args(argv)
    scheme = FINGERPRINT_SCHEME
    if args.cache:
        scheme = TeacherCache.open(args.cache).descriptor.teacher_fingerprint_scheme
    t0 = time.perf_counter()
    fp, info = teacher_fingerprint_info(args.model, scheme, rehash=args.rehash)
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"fingerprint": fp, "scheme": scheme, "seconds": round(seconds, 3), **info}, indent=1))
        return 0
    print(fp)
    kept = f"record {info['record']}" if info["kept"] else f"record not writable ({info['record']}): set ${RECORD_ENV}"
    print(f"gkd fingerprint: scheme {scheme}, {len(info['hashed'])} file(s) hashed, {len(info['reused'])} from the "
          f"record, {seconds:.2f} s; {kept}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lifetime.mark_command()  # what any command starts dies with it, also after kill -9 (pipeline/lifetime.py)
    # `--verbose` anywhere: every third-party log and warning too, here and in every subprocess (pipeline/logs.py).
    argv, loud = logs.strip_verbose(argv)
    if loud:
        logs.configure(verbose_now=True)
    commands = {"cache": ("", "inspect or verify a teacher cache"),
                "fingerprint": ("", "a teacher's fingerprint (warms the record score tasks reuse)"), **STAGES}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: gkd <command> [args]\n\ncommands:")
        for name, (_, text) in commands.items():
            print(f"  {name:<10} {text}")
        print("\n`gkd <command> --help` for a command's options; `--verbose` anywhere shows third-party logs.")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in commands:
        print(f"gkd: unknown command {command!r}; known: {', '.join(commands)}", file=sys.stderr)
        return 2
    if command == "cache":
        return cache_main(rest)
    if command == "fingerprint":
        return fingerprint_main(rest)
    # every stage's main wears pipeline.errors.command: a refusal comes back as exit 2 with its message printed
    return int(importlib.import_module(STAGES[command][0]).main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
