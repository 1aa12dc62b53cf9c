"""The readers of `gkd cache import` (pipeline/store/imports.py): each turns one tool's teacher-output files into
`ImportedSequence`s in our alignment (row i = the teacher of token `start + i` given the tokens before it). The
layouts, and the versions of the tools' code they were read from, are in imports.py's docstring and
docs/dependencies.md ("Other tools' teacher output")."""

from __future__ import annotations

import io
import json
import math
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.errors import UserError
from pipeline.store.export import DESCRIPTOR_KEY

MEGATRON_TAR = re.compile(r"^cp(?P<cp>\d+)_dp(?P<dp>\d+)__(?P<iter>\d+)\.tar$")
MEGATRON_META = "_meta.json"
MEGATRON_MEMBER = re.compile(r"^(?P<iter>\d+)\.pt\.zst$")


class ImportInputError(UserError, ValueError):
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
