"""Files in other tools' teacher-output layouts, written from those layouts as their code defines them (read at
arcee-ai/DistillKit a61c2e7 and NVIDIA/Megatron-LM 0e099c7 / 059030b; docs/dependencies.md), independently of
pipeline/store/imports.py, so an import test checks our reader against the layout and not against itself.

Each writer takes per-sequence arrays in the tools' own alignment: row t of `ids`/`logprobs` is the teacher's
top-k for token t+1 given tokens 0..t (vLLM prompt_logprobs without entry 0; Megatron's logits at position t),
in descending-logprob order.
"""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def _bitpack(values: np.ndarray, bits: int) -> np.ndarray:
    """DistillKit's pack_to_bytes: each row's integers as `bits`-bit fields, most significant bit first, padded to
    whole bytes."""
    fields = (values[..., None] >> np.arange(bits - 1, -1, -1)) & 1
    return np.packbits(fields.reshape(values.shape[0], -1).astype(np.uint8), axis=1)


def write_distillkit(folder: Path, sequences: list[tuple[np.ndarray, np.ndarray, np.ndarray]], *, vocab: int,
                     k: int, exact_k: int | None = None, bin_bits: int = 8) -> dict:
    """DistillKit's sample_logits output: `compression_config.yaml` and a Parquet file of compressed_logit_schema
    rows (input_ids, compressed_logprobs, bytepacked_indices). Each sequence: (input_ids [L], ids [L-1, k],
    logprobs [L-1, k]). Logprobs are delta encoded; the first `exact_k` (default k) deltas are float32, the rest one
    residual bin of `bin_bits`-bit integers with a float32 scale (max |delta| / 2^(bits-1), stored q - q_min).
    Returns the config."""
    exact_k = k if exact_k is None else exact_k
    bins = [] if exact_k == k else [{"scale_dtype": "float32", "element_bits": bin_bits, "num_elements": k - exact_k}]
    cfg = {"d": vocab, "k": k, "exact_k": exact_k, "exact_dtype": "float32", "polynomial_terms": None,
           "term_dtype": "float32", "residual_bins": bins, "delta_encoding": True, "error_diffusion": False,
           "normalize_t": False}
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "compression_config.yaml").write_text(yaml.safe_dump(cfg))
    id_bits = math.ceil(math.log2(vocab))
    rows = {"input_ids": [], "compressed_logprobs": [], "bytepacked_indices": []}
    for input_ids, ids, lps in sequences:
        lps = lps.astype(np.float64)
        deltas = np.concatenate([lps[:, :1], np.diff(lps, axis=1)], axis=1)
        chunks = [deltas[:, :exact_k].astype("<f4").view(np.uint8).reshape(len(lps), -1)]
        if bins:
            rest = deltas[:, exact_k:]
            scale = (np.abs(rest).max(1, keepdims=True) / 2 ** (bin_bits - 1)).astype(np.float32)
            scale[scale == 0] = 1.0
            q = np.clip(np.round(rest / scale), -(2 ** (bin_bits - 1)), 2 ** (bin_bits - 1) - 1) + 2 ** (bin_bits - 1)
            chunks += [scale.astype("<f4").view(np.uint8).reshape(len(lps), -1), _bitpack(q.astype(np.int64), bin_bits)]
        rows["input_ids"].append([int(t) for t in input_ids])
        rows["compressed_logprobs"].append(np.concatenate(chunks, axis=1).tolist())
        rows["bytepacked_indices"].append(_bitpack(ids.astype(np.int64), id_bits).tolist())
    schema = pa.schema([("input_ids", pa.list_(pa.uint64())),
                        ("compressed_logprobs", pa.list_(pa.list_(pa.uint8()))),
                        ("bytepacked_indices", pa.list_(pa.list_(pa.uint8())))])
    pq.write_table(pa.table(rows, schema=schema), folder / "part-0.parquet")
    return cfg


def write_megatron(folder: Path, sequences: list[tuple[np.ndarray, np.ndarray]], *, k: int, seq_len: int,
                   micro_batch: int = 2, iterations_per_tar: int = 2, save_dtype: str = "fp32") -> list[Path]:
    """Megatron-LM's LogitsSaverHooks output of a DP=CP=1 run: tars `cp0_dp0__{last_iter}.tar`, each `_meta.json`
    then `{iteration}.pt.zst` members (zstd-3 of torch.save of values [seq, batch, K] per micro-batch and the
    indices as uint16 low bits + a bool 17th bit). Each sequence: (ids [n, k], logprobs [n, k]) for positions
    0..n-1 (n <= seq_len; the rest padded as Megatron's padded sequences are); one micro-batch per iteration."""
    import torch
    import zstandard

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[save_dtype]
    folder.mkdir(parents=True, exist_ok=True)
    meta = json.dumps({"hash": "0" * 32, "identifiers": {"seed": 1, "sequence_length": seq_len},
                       "saver": {"k": k, "p": None, "min_k": 1, "save_dtype": save_dtype}}).encode()
    payloads = []
    for start in range(0, len(sequences), micro_batch):
        group = sequences[start : start + micro_batch]
        values = torch.full((seq_len, len(group), k), -30.0)
        index = torch.zeros((seq_len, len(group), k), dtype=torch.int64)
        for b, (ids, lps) in enumerate(group):
            values[: len(lps), b] = torch.as_tensor(lps)
            index[: len(ids), b] = torch.as_tensor(ids)
        buf = io.BytesIO()
        torch.save({"values": [values.to(dtype)], "indices_low": [(index & 0xFFFF).to(torch.uint16)],
                    "bit_17": [(index >> 16).to(torch.bool)]}, buf)
        payloads.append(zstandard.ZstdCompressor(level=3).compress(buf.getvalue()))
    tars = []
    for t0 in range(0, len(payloads), iterations_per_tar):
        iters = list(range(t0 + 1, min(t0 + iterations_per_tar, len(payloads)) + 1))  # Megatron counts from 1
        path = folder / f"cp0_dp0__{iters[-1]}.tar"
        with tarfile.open(path, "w") as tar:
            for name, data in [("_meta.json", meta)] + [(f"{i}.pt.zst", payloads[i - 1]) for i in iters]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        tars.append(path)
    return tars
