"""A full disk (ENOSPC) at a trainer checkpoint and in `gkd export` (a small tmpfs, tests/full_disk.py; root only):
the error names the checkpoint / export folder and the cause, no partial checkpoint or export is visible (`latest`
still names the previous complete checkpoint), and once space is freed the same command completes: the resumed
run's per-step losses and final checkpoint equal an uninterrupted run's, the export equals one written elsewhere."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from full_disk import fill, leftovers, small_fs, visible

from pipeline.cli import main as gkd


def _overrides(tiny: dict, save_dir: Path) -> list[str]:
    args = dict(student=str(tiny["student"]), cache=f"[{tiny['cache']}]", micro_batch_size=2, global_batch_size=4,
                seq_length=32, train_steps=4, save_interval=2, lr=1e-3, warmup_steps=1, save_dir=str(save_dir),
                progress=False, prefetch=1, optimizer="sgd")
    return [f"{k}={v}" for k, v in args.items()]


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _losses(save_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in map(json.loads, (save_dir / "metrics.jsonl").read_text().splitlines())]


def _digests(folder: Path) -> dict[str, str]:
    """The data files' digests (tensors: weights and optimizer state); not trainer.json or dist_checkpointing's
    .metadata, which record the folder they were written in."""
    out = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
           and p.name != "trainer.json" and not p.name.startswith(".")}
    assert out, folder
    return out


@pytest.fixture(scope="module")
def clean(tiny, tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("clean") / "run"
    assert gkd(["train", *_overrides(tiny, save_dir)]) == 0
    return save_dir


def test_checkpoint_on_a_full_disk_then_resume(tiny, clean, tmp_path, capsys):
    ckpt = _du(clean / "step_0000002")
    with small_fs(tmp_path / "disk", "8m") as disk:
        run = disk / "run"
        ballast = fill(disk, int(1.5 * ckpt))  # room for the step-2 checkpoint, not for step 4's
        capsys.readouterr()
        assert gkd(["train", *_overrides(tiny, run)]) == 2
        err = capsys.readouterr().err
        assert f"{run}/step_0000004: checkpoint save failed (resume continues from latest)" in err, err
        assert "No space left on device (errno ENOSPC)" in err and "then rerun the same command" in err, err
        assert (run / "latest").read_text() == "step_0000002"
        assert not any(p.startswith("run/step_0000004") for p in visible(disk)) and leftovers(disk) == []
        ballast.unlink()
        assert gkd(["train", *_overrides(tiny, run)]) == 0  # resumes from step 2
        assert (run / "latest").read_text() == "step_0000004" and leftovers(disk) == []
        assert _losses(run) == _losses(clean)  # each step once, the same losses (SGD: exact on resume)
        assert _digests(run / "step_0000004") == _digests(clean / "step_0000004")


def test_export_on_a_full_disk(clean, tmp_path, capsys):
    assert gkd(["export", "--checkpoint", str(clean), "--out", str(tmp_path / "ref")]) == 0
    size = _du(tmp_path / "ref")
    with small_fs(tmp_path / "disk", "4m") as disk:
        out = disk / "hf"
        ballast = fill(disk, size // 2)
        capsys.readouterr()
        assert gkd(["export", "--checkpoint", str(clean), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{out}: " in err and "No space left on device (errno ENOSPC)" in err, err
        assert visible(disk) == [] and leftovers(disk) == []
        ballast.unlink()
        assert gkd(["export", "--checkpoint", str(clean), "--out", str(out)]) == 0
        assert _digests(out) == _digests(tmp_path / "ref") and leftovers(disk) == []
