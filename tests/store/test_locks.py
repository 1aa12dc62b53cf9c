"""Writer locks (pipeline/store/locks.py) and two writers on one cache, with real processes."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.store import TeacherCache
from pipeline.store.locks import FileLock, LockHeldError

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{HERE.parents[1]}{os.pathsep}{HERE.parent}"}


def _holder(lock: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(HERE / "_lock_writer.py"), "hold", str(lock)], env=ENV,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_holder_is_refused_naming_the_first_and_a_killed_holder_holds_nothing(tmp_path):
    lock = tmp_path / "task.lock"
    proc = _holder(lock)
    try:
        with pytest.raises(LockHeldError) as e:
            FileLock(lock, "score task T").acquire()
        msg = str(e.value)
        assert f"pid {proc.pid}" in msg and socket.gethostname() in msg and "score task T" in msg and str(lock) in msg
        assert "_lock_writer.py hold" in msg  # the holder's command line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert lock.exists()  # a SIGKILLed holder leaves its file (with a dead pid) behind ...
    with FileLock(lock, "score task T"):  # ... and blocks nobody: the kernel dropped its flock
        assert str(os.getpid()) in lock.read_text()
    assert not lock.exists()  # a released lock removes its file


def test_holder_description_replaces_a_longer_stale_one_whole(tmp_path):
    """A killed holder's description, longer than ours, is overwritten and cut to ours (written over, not truncated
    to 0 first: locks.py), so a refused writer reads the live holder, not a splice of the two."""
    lock = tmp_path / ".commit.lock"
    lock.write_text(json.dumps({"pid": 1, "host": "gone", "since": 0.0, "command": "x" * 5000}))
    with FileLock(lock, "a writer of this cache"):
        info = json.loads(lock.read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname() and "x" * 10 not in lock.read_text()
        assert lock.stat().st_size == len(json.dumps(info).encode())


def test_waiting_lock_times_out_with_the_holder_named(tmp_path):
    lock = tmp_path / ".commit.lock"
    proc = _holder(lock)
    try:
        with pytest.raises(LockHeldError, match=f"pid {proc.pid}"):
            FileLock(lock, "a writer of this cache", wait_s=0.2).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_two_writers_of_overlapping_rows_write_each_key_once(tmp_path):
    """Two processes started together on a new cache, rows 0..29 and 15..44 (15 shared), parts of 3 rows: whatever
    the interleaving, each key is in the cache once and verify is clean."""
    root = tmp_path / "cache"
    cmd = [sys.executable, str(HERE / "_lock_writer.py"), "add", str(root)]
    procs = [subprocess.Popen(cmd + [name, lo, hi], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, lo, hi in (("a", "0", "30"), ("b", "15", "45"))]
    outs = [p.communicate(timeout=1800) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    dropped = sum(int(o[0].split()[-1]) for o in outs)
    cache = TeacherCache.open(root)
    keys = [k for p in cache.shard_paths() for k in pq.read_table(p, columns=["key"])["key"].to_pylist()]
    assert len(keys) == len(set(keys)) == 45
    assert dropped == 15  # every shared row was left out by exactly one of the two
    assert cache.verify() == []
    from pipeline.cli import main as gkd

    assert gkd(["cache", "verify", str(root)]) == 0  # the command a user runs
    assert not [p for p in root.rglob(".*") if p.name != ".commit.lock"] and not (root / ".commit.lock").exists()
