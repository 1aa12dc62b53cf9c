"""`gkd cache export` (pipeline/store/export.py): the plain Parquet read back by `datasets` and by pyarrow equals
`read_cache` row by row, position by position."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.cli import main as gkd
from pipeline.store import read_cache


def _check_rows(by_key: dict, cache) -> int:
    """Every scored position of every cached sample against its exported row; returns the positions checked."""
    n = 0
    for s in read_cache(cache):
        rows = by_key.pop(s.key)
        assert [r["position"] for r in rows] == list(range(s.first_scored, len(s.input_ids)))  # in order
        for i, r in enumerate(rows):
            j = s.first_scored + i
            assert r["sample_id"] == s.sample_id and r["token_id"] == s.input_ids[j]
            np.testing.assert_array_equal(np.asarray(r["topk_ids"]), s.topk_ids[i])
            np.testing.assert_array_equal(np.asarray(r["topk_logprobs"], np.float32), s.topk_logprobs[i])
            assert np.float32(r["tail_logprob"]) == s.tail_logprobs[i]
            assert np.float32(r["actual_logprob"]) == s.actual_logprobs[i] and r["actual_rank"] == s.actual_ranks[i]
            n += 1
    assert not by_key, "exported rows of no cached sample"
    return n


def _group(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r["key"], []).append(r)
    return out


def test_export_read_back_with_datasets_and_pyarrow_equals_read_cache(scored_rollouts, tmp_path, capsys):
    import datasets

    out = tmp_path / "plain"
    assert gkd(["cache", "export", str(scored_rollouts["cache"]), "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    positions = sum(len(r["completion_ids"]) for r in scored_rollouts["rows"])
    assert f"6 samples, {positions} positions in 2 file(s)" in summary
    files = sorted(out.glob("*.parquet"))
    assert [f.name for f in files] == ["part-00000.parquet", "part-00001.parquet"]

    table = pq.read_table(out)  # the folder as one dataset
    assert _check_rows(_group(table.to_pylist()), scored_rollouts["cache"]) == positions
    md = pq.read_schema(files[0]).metadata
    desc = json.loads(md[b"gkd.descriptor"])
    assert desc["k"] == 8 and desc["codec"]["name"] == "exact-f32" and "one per scored position" in md[b"gkd.export"].decode()
    assert table.schema.field("topk_ids").type.value_type == pa.int32()

    ds = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                               cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == positions
    assert _check_rows(_group(list(ds)), scored_rollouts["cache"]) == positions


def test_export_refuses_an_existing_folder(scored_rollouts, tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    assert gkd(["cache", "export", str(scored_rollouts["cache"]), "--out", str(tmp_path / "plain")]) == 2
    assert "already exists; pass --out a new folder" in capsys.readouterr().err
