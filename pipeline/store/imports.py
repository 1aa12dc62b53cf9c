"""Another tool's top-k teacher output into a content-keyed cache, matched against the rollouts it was scored on.

    gkd cache import --from plain      --in EXPORT_DIR  --rollouts R --cache C                      # our export
    gkd cache import --from distillkit --in DK_DIR      --rollouts R --cache C --teacher MODEL_DIR
    gkd cache import --from megatron   --in LOGITS_DIR  --rollouts R --cache C --teacher-fingerprint FP --vocab-size V

Each reader turns its format into per-sequence top-k arrays in *our* alignment (row for token j = the teacher's
distribution of x_j given x_<j); `import_rows` then matches them with rollouts, checks everything and only then
writes (two passes over the file: the first checks every row and writes nothing, the second writes).

Formats (docs/dependencies.md, "Importing other tools' teacher output", says which code was read):
- `plain`: `gkd cache export`'s Parquet (pipeline/store/export.py): rows by `sample_id`, per position; the tokens
  (`token_id` at `position`) must equal the rollout's; the descriptor in the files gives the teacher fingerprint,
  tokenizer, k, codec and numerics, so an export re-imported equals its cache row for row, key for key.
- `distillkit`: DistillKit's `sample_logits` output (arcee-ai/DistillKit `distillkit/sample_common.py`
  `compressed_logit_schema`, `distillkit/compression/`): Parquet rows `input_ids` (list<uint64>, the whole
  sequence), `compressed_logprobs` and `bytepacked_indices` (list<list<uint8>>, one entry per position 1..L-1,
  vLLM's prompt_logprobs without entry 0), plus `compression_config.yaml` in the folder. Ids are bit-packed at
  ceil(log2 d) bits, most significant bit first, in descending-logprob order; logprobs are (optionally) delta
  encoded, then split into `exact_k` values of `exact_dtype`, polynomial coefficients of `term_dtype` for the rest,
  and residual bins (a scale, then `element_bits`-bit integers). Matched to rollouts by content (input_ids).
- `megatron`: Megatron-LM's offline-KD logits (`megatron/training/distillation/logits_saver.py`,
  `utils_logits.py`): `cp{C}_dp{D}__{I}.tar` files, each a `_meta.json` member (dataset hash, `saver.k`, `saver.p`,
  `save_dtype`) then `{iteration}.pt.zst` members: zstd of `torch.save({'values', 'indices_low', 'bit_17'})`, one
  [seq, batch, K] tensor per micro-batch (log-softmax values; id = bit_17 << 16 | indices_low). Logits at sequence
  position t are the teacher of token t+1. It stores no tokens: Megatron aligns by data order, so sequence i (tars
  by iteration, micro-batches in order, batch index within) is rollout i in the rollouts' order, one rollout per
  sequence from position 0 — the count and lengths are checked, the tokens cannot be.

Neither DistillKit nor Megatron-LM stores the actual token's logprob: where x_j is in the top-k it is read from
there (exact, with its rank); where it is not, the row stores the bound the top-k gives — logprob
min(k-th logprob, tail) and rank k+1 — and the descriptor's numerics say `actual_outside_topk: bound`, so such rows
are never mixed with scored ones (reverse-KL and tail losses read the actual logprob: prefer rescoring there).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pipeline.store import codec
from pipeline.store.cache import COMMIT_LOCK, COMMIT_WAIT_S, DESCRIPTOR, CacheMismatchError, Descriptor, TeacherCache
from pipeline.store.fingerprint import new_digest, teacher_fingerprint
from pipeline.store.import_formats import OPENERS, ImportedSequence, ImportInputError, Source
from pipeline.store.locks import FileLock
from pipeline.store.model_config import vocab_size
from pipeline.store.rollouts import iter_rollouts, rollout_key, rollout_shards, rollout_tokenizer
from pipeline.store.shards import ShardError

FORMATS = ("plain", "distillkit", "megatron")
PART_ROWS = 256


# -- matching and writing --------------------------------------------------------------------------------------


def actual_from_topk(ids: np.ndarray, lps: np.ndarray, actual: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """(actual logprobs, ranks, all exact) of the tokens `actual` from rank-ordered top-k rows: exact where the
    token is among them; elsewhere the bound the top-k gives (module doc)."""
    hit = ids == actual[:, None]
    inside = hit.any(1)
    rank = np.where(inside, hit.argmax(1) + 1, ids.shape[1] + 1)
    tail = codec.tail_logprob(lps)
    bound = np.minimum(lps[:, -1], tail) if ids.shape[1] else tail
    lp = np.where(inside, lps[np.arange(len(ids)), hit.argmax(1)], bound)
    return lp.astype(np.float32), rank.astype(np.int64), bool(inside.all())


def _match(seqs: Iterator[ImportedSequence], src: Source, rollouts: list[dict], teacher_fp: str, k: int, mode: str,
           score_prompt: bool, vocab_size: int) -> Iterator[tuple[dict, bool]]:
    """Each file sequence as a cache row (and whether its actual logprobs are exact), matched with its rollout;
    ImportInputError naming the row and the fix for any mismatch."""
    by_sid = {r["sample_id"]: r for r in rollouts}
    by_ids = {tuple(r["prompt_ids"] + r["completion_ids"]): r for r in rollouts}
    i = -1
    for i, s in enumerate(seqs):
        if src.fmt == "plain":
            r = by_sid.get(s.sample_id)
            if r is None:
                raise ImportInputError(f"{s.where}: no rollout with this sample_id in the rollouts; import against the "
                                   "rollouts the cache was scored on")
        elif src.fmt == "distillkit":
            r = by_ids.get(tuple(int(t) for t in s.input_ids))
            if r is None:
                raise ImportInputError(f"{s.where}: its input_ids ({len(s.input_ids)} tokens: {s.input_ids[:8].tolist()} "
                                   "...) equal no rollout's prompt_ids + completion_ids; the tokens must match "
                                   "exactly (same tokenizer, same text, no added pad token)")
        else:
            if i >= len(rollouts):
                raise ImportInputError(f"{s.where}: more sequences than the {len(rollouts)} rollouts; Megatron-LM files "
                                   "align by order, so they must hold exactly one sequence per rollout, in order")
            r = rollouts[i]
        ids = np.asarray(r["prompt_ids"] + r["completion_ids"], np.int64)
        first = 1 if score_prompt else len(r["prompt_ids"])
        key = rollout_key(r, teacher_fp, k, mode, score_prompt=score_prompt)
        if key is None:
            continue  # a row the score stage skips (empty completion or prompt)
        if s.topk_ids.shape[1] != k:
            raise ImportInputError(f"{s.where}: k={s.topk_ids.shape[1]} entries per position, the cache holds k={k}")
        lo, hi = first - s.start, len(ids) - s.start  # file rows of positions first..L-1
        if lo < 0 or (src.fmt != "megatron" and s.start + len(s.topk_ids) != len(ids)) or len(s.topk_ids) < hi:
            raise ImportInputError(f"sample {r['sample_id']} ({s.where}): the file covers positions {s.start}.."
                               f"{s.start + len(s.topk_ids) - 1}, the rollout has {len(ids)} tokens and scoring "
                               f"needs positions {first}..{len(ids) - 1}"
                               + ("; with the prompt positions missing, import without --score-prompt" if lo < 0
                                  else "; the tokens do not match this rollout"))
        if s.token_ids is not None and not np.array_equal(s.token_ids, ids[s.start :]):
            j = s.start + int(np.flatnonzero(s.token_ids != ids[s.start :])[0])
            raise ImportInputError(f"sample {r['sample_id']} ({s.where}): token_id at position {j} is "
                               f"{s.token_ids[j - s.start]}, the rollout's is {ids[j]}; the tokens must match exactly")
        top_ids, top_lps = s.topk_ids[lo:hi], s.topk_logprobs[lo:hi]
        if top_ids.size and (top_ids.min() < 0 or top_ids.max() >= vocab_size):
            raise ImportInputError(f"sample {r['sample_id']} ({s.where}): top-k ids outside [0, {vocab_size}): another "
                               "vocabulary (the teacher's tokenizer is not the rollouts')")
        if not np.isfinite(top_lps).all():
            raise ImportInputError(f"sample {r['sample_id']} ({s.where}): non-finite top-k logprobs (fewer than k "
                               "entries per position?); import files of complete top-k rows")
        if s.actual_logprobs is not None:
            alp, arank, exact = s.actual_logprobs[lo:hi], s.actual_ranks[lo:hi], True
        else:
            order = np.argsort(-top_lps, axis=1, kind="stable")  # rank order, as our rows and the bound assume
            top_ids, top_lps = np.take_along_axis(top_ids, order, 1), np.take_along_axis(top_lps, order, 1)
            alp, arank, exact = actual_from_topk(top_ids, top_lps, ids[first:])
        yield ({"key": key, "sample_id": r["sample_id"], "source": r["source"], "policy_version": r["policy_version"],
                "input_ids": ids.astype(np.int32), "first_scored": first, "tags": r.get("tags") or None,
                "topk_ids": top_ids.astype(np.int32), "topk_logprobs": top_lps.astype(np.float32),
                "actual_ranks": arank.astype(np.int32), "actual_logprobs": alp.astype(np.float32)}, exact)
    if src.fmt == "megatron" and i + 1 != len(rollouts):
        raise ImportInputError(f"{src.path}: {i + 1} sequences for {len(rollouts)} rollouts; Megatron-LM files align by "
                           "order, so they must hold exactly one sequence per rollout, in order")


@dataclass
class ImportRequest:
    fmt: str
    source: Path
    rollouts: Path
    cache: Path
    teacher: Path | None = None  # model folder: its fingerprint and vocab size
    teacher_fingerprint: str | None = None
    vocab_size: int | None = None
    codec: str | None = None  # default: the export's (plain), else our default codec
    score_prompt: bool = False
    logprob_mode: str = "raw_logprobs"


def import_rows(req: ImportRequest, progress=None) -> dict:
    """Check the whole file against the rollouts and the cache (writing nothing), then write its rows into the
    cache as parts `import-<format>-<hash>-pNNNN` (keys already there are left out) and record the import in
    cache.json. Returns counts."""
    if req.fmt not in FORMATS:
        raise ImportInputError(f"--from {req.fmt}: one of {', '.join(FORMATS)}")
    if not req.source.exists():
        raise ImportInputError(f"{req.source}: no such file or folder")
    src, _ = OPENERS[req.fmt](req.source)
    paths = rollout_shards(req.rollouts)
    if not paths:
        raise ImportInputError(f"{req.rollouts}: no complete rollout shards (*.parquet with a .ok marker)")
    tok_fps = {rollout_tokenizer(p) for p in paths}
    if len(tok_fps) != 1 or None in tok_fps:
        raise ImportInputError(f"{req.rollouts}: its shards record {len(tok_fps)} tokenizer fingerprint(s) "
                           f"({sorted(map(str, tok_fps))}); import against rollouts of one known tokenizer")
    tok_fp = tok_fps.pop()
    d = src.descriptor or {}
    if d and d.get("tokenizer_fingerprint") != tok_fp:
        raise ImportInputError(f"{req.source}: exported from a cache of tokenizer {d.get('tokenizer_fingerprint')}, the "
                           f"rollouts {req.rollouts} were tokenized with {tok_fp}: import against the rollouts that "
                           "cache was scored on")
    vocab = req.vocab_size
    if req.teacher is not None:
        if not (Path(req.teacher) / "config.json").is_file():
            raise ImportInputError(f"--teacher {req.teacher}: no config.json (pass the teacher's model folder)")
        fp = teacher_fingerprint(req.teacher)
        config = json.loads((Path(req.teacher) / "config.json").read_text())
        vocab = vocab or vocab_size(config)
    else:
        fp = req.teacher_fingerprint or d.get("teacher_fingerprint")
    if not fp:
        raise ImportInputError(f"--from {req.fmt}: which teacher wrote {req.source}? Pass --teacher MODEL_DIR (its "
                           "fingerprint is hashed from its files) or --teacher-fingerprint FP")
    vocab = vocab or src.vocab_size
    if not vocab:
        raise ImportInputError(f"--from {req.fmt}: {req.source} does not say the vocabulary size; pass --vocab-size V "
                           "or --teacher MODEL_DIR")
    k = src.k
    name = req.codec or d.get("codec", {}).get("name") or codec.NAME
    numerics = d.get("numerics") if d else {"imported_from": req.fmt, "actual_outside_topk": "bound"}
    mode = d.get("logprob_mode", req.logprob_mode)
    descriptor = Descriptor(teacher_fingerprint=fp, tokenizer_fingerprint=tok_fp, k=k, logprob_mode=mode,
                            teacher=d.get("teacher") or f"imported from {req.fmt} {req.source}",
                            vocab_size=int(vocab), engine=d.get("engine") or f"import --from {req.fmt}",
                            codec=codec.params(name), numerics=numerics, teacher_probe=d.get("teacher_probe"))
    _check_cache(req.cache, descriptor)
    rollouts = list(iter_rollouts(paths))

    def matched() -> Iterator[tuple[dict, bool]]:
        _, seqs = OPENERS[req.fmt](req.source)
        return _match(seqs, src, rollouts, fp, k, mode, req.score_prompt, int(vocab))

    # pass 1: every row checked, nothing written
    n_rows = n_pos = 0
    seen: set[str] = set()
    for row, _exact in matched():
        if row["key"] in seen:
            raise ImportInputError(f"{req.source}: sample {row['sample_id']} appears twice; each rollout once")
        seen.add(row["key"])
        n_rows += 1
        n_pos += len(row["topk_ids"])
    if n_rows == 0:
        raise ImportInputError(f"{req.source}: no rows to import")

    # pass 2: write
    cache = TeacherCache.create_or_open(req.cache, descriptor)
    tag = _source_tag(req)
    have = cache.keys()
    parts, buf, written, inexact = 0, [], 0, 0
    for row, exact in matched():
        inexact += 0 if exact else 1
        if row["key"] in have:
            continue
        buf.append(row)
        if len(buf) >= PART_ROWS:
            written += _write(cache, f"import-{req.fmt}-{tag}-p{parts:04d}", buf)
            parts, buf = parts + 1, []
        if progress is not None:
            progress(len(row["topk_ids"]))
    if buf:
        written += _write(cache, f"import-{req.fmt}-{tag}-p{parts:04d}", buf)
    record = {"format": req.fmt, "source": str(req.source), "layout": src.version, "rows": str(n_rows),
              "written": str(written), "actual_outside_topk": str(inexact),
              "at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), **src.extra}
    _record_import(cache, record)
    return {"rows": n_rows, "positions": n_pos, "written": written, "already_cached": n_rows - written,
            "rollouts_without_rows": len(rollouts) - n_rows, "actual_outside_topk_rows": inexact,
            "cache": str(req.cache)}


def _check_cache(root: Path, descriptor: Descriptor) -> None:
    """The existing cache at `root` (if any) must take these rows: refused before anything is written."""
    path = Path(root) / DESCRIPTOR
    if Path(root).exists() and not Path(root).is_dir():
        raise ShardError(f"{root}: is a file, not a teacher cache directory; pass --cache a directory")
    if path.exists():
        problems = Descriptor.read(path).mismatches(descriptor)
        if problems:
            raise CacheMismatchError(f"{path}: these rows cannot be mixed into this cache:\n  - "
                                     + "\n  - ".join(problems) + "\nImport into another --cache directory.")


def _write(cache: TeacherCache, name: str, rows: list[dict]) -> int:
    info, dropped = cache.add_rows(name, rows, extra={"task": name})
    return len(rows) - dropped if info is not None else 0


def _source_tag(req: ImportRequest) -> str:
    h = new_digest()
    h.update(f"{req.fmt}|{req.source.resolve()}|{req.score_prompt}".encode())
    return h.hexdigest()[:10]


def _record_import(cache: TeacherCache, record: dict) -> None:
    """Append `record` to cache.json's `imports` (rewritten atomically under the commit lock)."""
    path = cache.root / DESCRIPTOR
    with FileLock(cache.root / COMMIT_LOCK, "a writer of this cache", wait_s=COMMIT_WAIT_S):
        current = Descriptor.read(path)
        updated = replace(current, imports=[*(current.imports or []), record])
        updated.write(path)
    cache.descriptor = updated


