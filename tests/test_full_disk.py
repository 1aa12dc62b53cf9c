"""A full disk (ENOSPC) during `gkd import`: a clear error naming the path and the cause, nothing partial visible,
and after space is freed the same command completes with the output of an uninterrupted run. (The score stage's
case is in tests/score/test_score.py, the trainer's checkpoint and export in tests/train/test_checkpoint_full_disk.py;
tests/full_disk.py mounts the small filesystem.)"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from full_disk import fill, leftovers, small_fs, visible

from pipeline.cli import main as gkd


def test_import_on_a_full_disk(tmp_path, capsys):
    from tiny_models import build_tokenizer

    build_tokenizer(tmp_path / "tok")
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"what is {i} times {i + 3}?", "response": f"it is {i * (i + 3)}"})
                           + "\n" for i in range(3000)))
    argv = ["import", "--dataset", str(src), "--tokenizer", str(tmp_path / "tok")]
    assert gkd([*argv, "--out", str(tmp_path / "clean")]) == 0
    size = (tmp_path / "clean" / "dataset-00000-of-00001.parquet").stat().st_size
    assert size > 64 * 1024, size  # big enough that the write below fails part of the way through
    with small_fs(tmp_path / "disk", "4m") as disk:
        ballast = fill(disk, size // 2)
        capsys.readouterr()
        assert gkd([*argv, "--out", str(disk / "out")]) == 2
        err = capsys.readouterr().err
        assert f"{disk}/out/dataset-00000-of-00001.parquet" in err and "No space left on device (errno ENOSPC)" in err, err
        assert "Free space on that filesystem, then rerun the same command" in err
        assert visible(disk) == [] and leftovers(disk) == []
        ballast.unlink()
        assert gkd([*argv, "--out", str(disk / "out")]) == 0
        assert visible(disk) == ["out/dataset-00000-of-00001.parquet", "out/dataset-00000-of-00001.parquet.ok"]
        assert pq.read_table(disk / "out" / "dataset-00000-of-00001.parquet").equals(
            pq.read_table(tmp_path / "clean" / "dataset-00000-of-00001.parquet"))
        assert leftovers(disk) == []


def test_visible_ignores_what_readers_ignore(tmp_path):  # the helper the full-disk tests rely on, checked once
    for name in ("a.parquet", ".a.parquet.tmp-1-x", "d.partial/f", ".hidden/g", "ballast"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert visible(tmp_path) == ["a.parquet"]
    assert leftovers(tmp_path) == [".a.parquet.tmp-1-x", "d.partial"]
    assert Path(tmp_path / "a.parquet").exists()
