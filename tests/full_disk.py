"""A size-limited filesystem for the full-disk (ENOSPC) tests: a tmpfs mounted by the test (needs root; CI runs as
root), and a ballast file that leaves a chosen number of bytes free, so a write fails part of the way through."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_fs(path: Path, size: str = "16m") -> Iterator[Path]:
    """Mount a tmpfs of `size` at `path` (skipping the test, with the reason, where that is impossible)."""
    if os.geteuid() != 0:
        pytest.skip("full-disk tests mount a small tmpfs, which needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                         text=True)
    if out.returncode:
        pytest.skip(f"cannot mount a tmpfs at {path}: {out.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int) -> Path:
    """Write a ballast file under `path` so that about `leave` bytes stay free; delete it to 'free the disk'."""
    ballast = path / "ballast"
    ballast.unlink(missing_ok=True)
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, free_bytes(path) - leave))
    assert abs(free_bytes(path) - leave) <= 64 * 1024, (free_bytes(path), leave)
    return ballast


def visible(root: Path) -> list[str]:
    """What a reader sees: every file not dot-prefixed and not inside a `.partial` folder, minus the ballast."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "ballast"
                  and not any(part.startswith(".") or part.endswith(".partial") for part in p.relative_to(root).parts))


def leftovers(root: Path) -> list[str]:
    """Temporaries and partial folders left behind (a failed write must remove its own)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.name.startswith(".") and ".tmp-" in p.name or p.name.endswith(".partial"))
