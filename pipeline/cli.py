"""`gkd`: one sub-command per stage, each handing its arguments to one plain function.

    gkd cache stats DIR        what a teacher cache holds (samples, tokens, bytes/token, fingerprints)
    gkd cache verify DIR       checksums, schema, descriptor; exits 1 naming every bad file
    gkd fingerprint MODEL      a teacher's fingerprint; warms the fingerprint record (pipeline/store/weights.py)
    gkd score ...              rollouts -> teacher top-k rows in the cache (pipeline/score)
    gkd generate ...           prompts -> student rollouts (pipeline/generate)
    gkd import ...             dataset responses -> off-policy rollouts (pipeline/generate)
    gkd train ...              Megatron-Core student on the cache (pipeline/train)

Stage modules are imported only when their command runs, so `gkd cache ...` starts without torch or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time

from pipeline import logs
from pipeline.store import TeacherCache
from pipeline.store.fingerprint import FINGERPRINT_SCHEME, teacher_fingerprint_info
from pipeline.store.weights import RECORD_ENV

# command -> (module with a `main(argv) -> int`, one-line help). Stages register here once they exist.
STAGES: dict[str, tuple[str, str]] = {}


def _register_available() -> None:
    for command, module, text in (
        ("score", "pipeline.score.run", "score rollouts with a vLLM teacher into a cache"),
        ("generate", "pipeline.generate.run", "sample student rollouts with vLLM"),
        ("import", "pipeline.generate.importer", "turn dataset responses into off-policy rollouts"),
        ("train", "pipeline.train.run", "train a Megatron-Core student on a teacher cache"),
        ("export", "pipeline.train.export", "export a trained student to a Hugging Face folder"),
        ("onpolicy", "pipeline.onpolicy.run", "alternate generate -> score -> train"),
        ("slurm", "pipeline.slurm.cli", "submit stages as Slurm jobs"),
        ("ray", "pipeline.ray.cli", "run stages as Ray tasks on a Ray cluster"),
        ("demo", "pipeline.demo", "the whole pipeline on the embedded default, with a report"),
    ):
        if importlib.util.find_spec(module) is not None:
            STAGES[command] = (module, text)


def cache_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gkd cache", description="Inspect a teacher cache.")
    sub = parser.add_subparsers(dest="action", required=True)
    p_stats = sub.add_parser("stats", help="samples, scored tokens, shards, bytes/token, k, fingerprints")
    p_stats.add_argument("dir")
    p_stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_verify = sub.add_parser("verify", help="checksums, schema, descriptor, codec; non-zero exit on any problem")
    p_verify.add_argument("dir")
    p_verify.add_argument("--no-decode", action="store_true", help="skip decoding every row (faster)")
    args = parser.parse_args(argv)

    try:
        cache = TeacherCache.open(args.dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"gkd cache {args.action}: {e}", file=sys.stderr)
        return 2
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
    try:
        scheme = FINGERPRINT_SCHEME
        if args.cache:
            scheme = TeacherCache.open(args.cache).descriptor.fingerprint_scheme or 1
        t0 = time.perf_counter()
        fp, info = teacher_fingerprint_info(args.model, scheme, rehash=args.rehash)
    except (FileNotFoundError, ValueError) as e:
        print(f"gkd fingerprint: {e}", file=sys.stderr)
        return 2
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
    # `--verbose` anywhere: every third-party log and warning too, here and in every subprocess (pipeline/logs.py).
    argv, loud = logs.strip_verbose(argv)
    if loud:
        logs.configure(verbose_now=True)
    _register_available()
    commands = {"cache": ("", "inspect or verify a teacher cache"),
                "fingerprint": ("", "a teacher's fingerprint (warms the record score tasks reuse)"), **STAGES}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: gkd <command> [args]\n\ncommands:")
        for name, (_, text) in commands.items():
            print(f"  {name:<10} {text}")
        print("\n`gkd <command> --help` for a command's options; `--verbose` anywhere shows third-party logs.")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "cache":
        return cache_main(rest)
    if command == "fingerprint":
        return fingerprint_main(rest)
    if command not in STAGES:
        print(f"gkd: unknown command {command!r}; known: {', '.join(commands)}", file=sys.stderr)
        return 2
    module = importlib.import_module(STAGES[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
