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

import io
import json
import math
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.store import codec
from pipeline.store.cache import COMMIT_LOCK, COMMIT_WAIT_S, DESCRIPTOR, CacheMismatchError, Descriptor, TeacherCache
from pipeline.store.export import DESCRIPTOR_KEY
from pipeline.store.fingerprint import _digest, teacher_fingerprint
from pipeline.store.locks import FileLock
from pipeline.store.rollouts import iter_rollouts, rollout_key, rollout_shards, rollout_tokenizer
from pipeline.store.shards import ShardError

FORMATS = ("plain", "distillkit", "megatron")
PART_ROWS = 256
MEGATRON_TAR = re.compile(r"^cp(?P<cp>\d+)_dp(?P<dp>\d+)__(?P<iter>\d+)\.tar$")
MEGATRON_META = "_meta.json"
MEGATRON_MEMBER = re.compile(r"^(?P<iter>\d+)\.pt\.zst$")


class ImportInputError(ValueError):
    """An import file that does not match the rollouts or the cache; the message names the file, the row or sample
    and the fix. Raised before anything is written."""


@dataclass
class ImportedSequence:
    """One sequence of an import file, in our alignment: topk row i is the teacher of token `start + i`."""

    where: str  # file and row, for messages
    start: int  # the position of the first row
    topk_ids: np.ndarray  # int64 [n, k]
    topk_logprobs: np.ndarray  # float32 [n, k]
    input_ids: np.ndarray | None = None  # the tokens, when the format stores them
    sample_id: str | None = None  # plain: the rollout it belongs to
    token_ids: np.ndarray | None = None  # plain: x_j of each row (checked against the rollout)
    actual_logprobs: np.ndarray | None = None  # plain: exact; others: derived
    actual_ranks: np.ndarray | None = None


@dataclass
class Source:
    """What a reader knows about its file(s): k, and for `plain` the exporting cache's descriptor."""

    fmt: str
    path: Path
    k: int
    version: str  # the layout's version, recorded in cache.json
    descriptor: dict | None = None
    vocab_size: int | None = None
    extra: dict = field(default_factory=dict)


# -- readers ---------------------------------------------------------------------------------------------------


def _parquet_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ImportInputError(f"{path}: no Parquet files (*.parquet) to import")
    return files


def open_plain(path: Path) -> tuple[Source, Iterator[ImportedSequence]]:
    files = _parquet_files(path)
    md = pq.read_schema(files[0]).metadata or {}
    if DESCRIPTOR_KEY not in md:
        raise ImportInputError(f"{files[0]}: no {DESCRIPTOR_KEY.decode()} in its metadata: not a `gkd cache export` file "
                           "(--from plain reads those; DistillKit or Megatron-LM output: --from distillkit/megatron)")
    desc = json.loads(md[DESCRIPTOR_KEY])
    src = Source("plain", path, int(desc["k"]), "gkd-export-1", descriptor=desc, vocab_size=desc.get("vocab_size"))

    def rows() -> Iterator[ImportedSequence]:
        for f in files:
            pending: dict | None = None
            for batch in pq.ParquetFile(f).iter_batches(batch_size=8192):
                cols = batch.to_pydict()
                for i, sid in enumerate(cols["sample_id"]):
                    if pending is not None and pending["sample_id"] != sid:
                        yield _plain_sequence(f, pending)
                        pending = None
                    if pending is None:
                        pending = {"sample_id": sid, **{c: [] for c in cols if c != "sample_id"}}
                    for c in cols:
                        if c != "sample_id":
                            pending[c].append(cols[c][i])
            if pending is not None:
                yield _plain_sequence(f, pending)

    return src, rows()


def _plain_sequence(f: Path, p: dict) -> ImportedSequence:
    pos = np.asarray(p["position"], np.int64)
    where = f"{f}: sample {p['sample_id']}"
    if np.any(np.diff(pos) != 1):
        raise ImportInputError(f"{where}: positions are not contiguous and ascending ({pos[:8].tolist()} ...); a sample's "
                           "rows must be consecutive, in position order (sort the file by sample_id, position)")
    widths = {len(x) for x in p["topk_ids"]} | {len(x) for x in p["topk_logprobs"]}
    if len(widths) != 1:
        raise ImportInputError(f"{where}: top-k lists of different lengths {sorted(widths)} (a top-p export imports "
                           "only into a fixed-k cache of its own k: not supported)")
    return ImportedSequence(where=where, start=int(pos[0]), sample_id=p["sample_id"],
                     topk_ids=np.asarray(p["topk_ids"], np.int64).reshape(len(pos), -1),
                     topk_logprobs=np.asarray(p["topk_logprobs"], np.float32).reshape(len(pos), -1),
                     token_ids=np.asarray(p["token_id"], np.int64),
                     actual_logprobs=np.asarray(p["actual_logprob"], np.float32),
                     actual_ranks=np.asarray(p["actual_rank"], np.int64))


# DistillKit's TermDtype names -> numpy (bfloat16: the high half of a float32)
_DK_DTYPES = {"float16": (np.float16, 2), "bfloat16": ("bf16", 2), "float32": (np.float32, 4), "float64": (np.float64, 8)}


def _dk_floats(b: np.ndarray, dtype: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` little-endian floats of DistillKit's `dtype` off the front of each row of bytes; (values, rest)."""
    kind, width = _DK_DTYPES[dtype]
    head, rest = b[:, : count * width], b[:, count * width :]
    if kind == "bf16":
        bits = np.ascontiguousarray(head).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64), rest
    return np.ascontiguousarray(head).view(np.dtype(kind).newbyteorder("<")).astype(np.float64), rest


def _unpack_bits(b: np.ndarray, bits: int, count: int) -> np.ndarray:
    """DistillKit's bitpack: `count` unsigned `bits`-bit integers per row, most significant bit first."""
    allbits = np.unpackbits(np.ascontiguousarray(b, np.uint8), axis=1)[:, : bits * count]
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.int64)
    return (allbits.reshape(len(b), count, bits).astype(np.int64) * weights).sum(-1)


def dk_decode_logprobs(b: np.ndarray, cfg: dict) -> np.ndarray:
    """DistillKit's compressed logprobs (one row of bytes per position) -> float32 [positions, k], in its layout:
    exact values, polynomial coefficients, residual bins (scale + packed ints), then the inverse delta encoding."""
    k, exact_k = int(cfg["k"]), int(cfg.get("exact_k", 0))
    exact, rest = _dk_floats(b, cfg.get("exact_dtype", "float32"), exact_k)
    terms = cfg.get("polynomial_terms") or []
    coeffs = None
    if terms:
        coeffs, rest = _dk_floats(rest, cfg.get("term_dtype", "float32"), len(terms))
    residuals = []
    for rb in cfg.get("residual_bins") or []:
        scale, rest = _dk_floats(rest, rb["scale_dtype"], 1)
        nbytes = (int(rb["num_elements"]) * int(rb["element_bits"]) + 7) // 8
        q, rest = _unpack_bits(rest[:, :nbytes], int(rb["element_bits"]), int(rb["num_elements"])), rest[:, nbytes:]
        bits = int(rb["element_bits"])
        residuals.append((q * 2.0 - 1.0) * scale if bits == 1 else (q - 2.0 ** (bits - 1)) * scale)
    approx = k - exact_k
    residual = np.concatenate(residuals, axis=1) if residuals else np.zeros((len(b), 0))
    residual = np.pad(residual, ((0, 0), (0, approx - residual.shape[1])))
    if coeffs is not None:
        t = np.linspace(0.0, 1.0, approx) if cfg.get("normalize_t") else np.arange(approx, dtype=np.float64)
        x = np.stack([t ** term if isinstance(term, int) else getattr(np, str(term))(t) for term in terms], axis=-1)
        residual = residual + coeffs @ x.T
    values = np.concatenate([exact, residual], axis=1)
    if cfg.get("delta_encoding", True):
        values = np.cumsum(values, axis=1)
    return values.astype(np.float32)


def open_distillkit(path: Path) -> tuple[Source, Iterator[ImportedSequence]]:
    import yaml

    folder = path if path.is_dir() else path.parent
    cfg_path = folder / "compression_config.yaml"
    if not cfg_path.is_file():
        raise ImportInputError(f"{folder}: no compression_config.yaml (DistillKit's sample_logits writes it beside its "
                           "Parquet output; copy it there)")
    cfg = yaml.safe_load(cfg_path.read_text()) or {}
    if "legacy" in cfg or "polynomial_degree" in cfg:
        raise ImportInputError(f"{cfg_path}: DistillKit's legacy compression (packed_indices/exact_values/coeffs) is not "
                           "read; resample with its current compressor")
    for name in ("d", "k"):
        if name not in cfg:
            raise ImportInputError(f"{cfg_path}: no '{name}' (DistillKit's DistributionQuantizationConfig)")
    files = _parquet_files(path)
    d, k = int(cfg["d"]), int(cfg["k"])
    id_bits = max(1, math.ceil(math.log2(d)))
    src = Source("distillkit", path, k, "DistillKit compressed_logit_schema (arcee-ai/DistillKit a61c2e7)",
                 vocab_size=d, extra={"compression": json.dumps(cfg, sort_keys=True, default=str)})
    need = {"input_ids", "compressed_logprobs", "bytepacked_indices"}

    def rows() -> Iterator[ImportedSequence]:
        for f in files:
            pf = pq.ParquetFile(f)
            missing = need - set(pf.schema_arrow.names)
            if missing:
                raise ImportInputError(f"{f}: no column(s) {', '.join(sorted(missing))} (DistillKit's compressed_logit_"
                                   f"schema has {', '.join(sorted(need))}; found {', '.join(pf.schema_arrow.names)})")
            r = 0
            for batch in pf.iter_batches(batch_size=64, columns=sorted(need)):
                for ids, lp, ix in zip(*(batch.column(c).to_pylist() for c in ("input_ids", "compressed_logprobs",
                                                                                  "bytepacked_indices")), strict=True):
                    where = f"{f}: row {r}"
                    r += 1
                    n = len(ids) - 1
                    if len(lp) != n or len(ix) != n:
                        raise ImportInputError(f"{where}: {len(lp)} logprob and {len(ix)} index entries for {len(ids)} "
                                           f"tokens; DistillKit stores one per token after the first ({n})")
                    lp_b, ix_b = np.asarray(lp, np.uint8).reshape(n, -1), np.asarray(ix, np.uint8).reshape(n, -1)
                    if ix_b.shape[1] * 8 < k * id_bits:
                        raise ImportInputError(f"{where}: {ix_b.shape[1]} index bytes per position, k={k} ids of "
                                           f"{id_bits} bits need {(k * id_bits + 7) // 8}: does compression_config."
                                           "yaml belong to this file?")
                    yield ImportedSequence(where=where, start=1, input_ids=np.asarray(ids, np.int64),
                                    topk_ids=_unpack_bits(ix_b, id_bits, k), topk_logprobs=dk_decode_logprobs(lp_b, cfg))

    return src, rows()


def open_megatron(path: Path) -> tuple[Source, Iterator[ImportedSequence]]:
    tars = sorted((int(m["iter"]), p) for p in (path.iterdir() if path.is_dir() else [path])
                  if (m := MEGATRON_TAR.match(p.name)))
    if not tars:
        raise ImportInputError(f"{path}: no Megatron-LM logits tars (cp<C>_dp<D>__<iteration>.tar)")
    ranks = {MEGATRON_TAR.match(p.name).group("cp", "dp") for _, p in tars}
    if ranks != {("0", "0")}:
        raise ImportInputError(f"{path}: tars of CP/DP ranks {sorted(ranks)}: a run saved from more than one data- or "
                           "context-parallel rank interleaves its sequences by rank; import a run saved with DP=CP=1")
    meta = _megatron_meta(tars[0][1])
    saver = meta.get("saver", {})
    if saver.get("p") is not None:
        raise ImportInputError(f"{tars[0][1]}: saved with top-p (saver.p={saver['p']}): variable-k Megatron files are not "
                           "imported; save with p unset")
    src = Source("megatron", path, int(saver["k"]), "Megatron-LM logits_saver batched tar (NVIDIA/Megatron-LM "
                 "0e099c7)", extra={"dataset_hash": str(meta.get("hash"))})

    def rows() -> Iterator[ImportedSequence]:
        import torch
        import zstandard

        n = 0
        for _, tar_path in tars:
            with tarfile.open(tar_path, "r") as tar:
                members = sorted((int(m["iter"]), mem) for mem in tar.getmembers()
                                 if (m := MEGATRON_MEMBER.match(mem.name)))
                for it, mem in members:
                    data = zstandard.ZstdDecompressor().decompress(tar.extractfile(mem).read())
                    payload = torch.load(io.BytesIO(data), weights_only=True)
                    for values, low, high in zip(payload["values"], payload["indices_low"], payload["bit_17"],
                                                 strict=True):
                        ids = (high.to(torch.int64) << 16) | low.to(torch.int64)
                        for b in range(values.shape[1]):
                            yield ImportedSequence(where=f"{tar_path}: iteration {it}, sequence {n}", start=1,
                                            topk_ids=ids[:, b].numpy(), topk_logprobs=values[:, b].float().numpy())
                            n += 1

    return src, rows()


def _megatron_meta(tar_path: Path) -> dict:
    with tarfile.open(tar_path, "r") as tar:
        try:
            return json.loads(tar.extractfile(MEGATRON_META).read())
        except KeyError:
            raise ImportInputError(f"{tar_path}: no {MEGATRON_META} member (Megatron-LM writes it first in every tar)") from None


OPENERS = {"plain": open_plain, "distillkit": open_distillkit, "megatron": open_megatron}


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
        vocab = vocab or int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0)
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
    h = _digest()
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


