"""Writer locks: one holder per task output, a short commit lock per cache, and the holder named on refusal.

Two kinds, one mechanism (`FileLock`):
- a *task lock* (`tasks/<task>.lock` in a cache, `.<shard>.lock` beside a rollout shard) is held for a whole run of
  one score / generate / import task; a second process of the same task is refused at once with the holder's pid,
  host, start time and command (`LockHeldError`): the case of a resubmitted array task overlapping a running one;
- the *commit lock* of a cache (`CACHE/.commit.lock`) is held for milliseconds around "which keys are there now?
  -> publish a part without them", so score tasks of different rollout sets or splits that overlap still write each
  content key once (`TeacherCache.add_rows`), and around creating `cache.json`.

The lock is the kernel's `flock` on the lock file; the file only carries the holder's description. So a holder
killed with SIGKILL (or whose node dies: on NFS once its lease expires) blocks nobody: its lock file stays behind
with a dead pid, the next writer takes the flock and overwrites the description (the stale-lock case needs no
timeout and no guess about liveness). Released locks remove their file; the inode check after acquiring closes the race with a
concurrent unlink. A filesystem without flock support (Lustre mounted without `-o flock`) is refused with that
cause, rather than writing unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from pipeline.store.shards import ShardError, WriteError

_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class LockHeldError(ShardError):
    """Another live process holds the lock; the message names it (pid, host, since, command)."""


def _describe(info: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"])) if "since" in info else "?"
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since {since}"
            + (f" ({info['command']})" if info.get("command") else ""))


class FileLock:
    """`with FileLock(path, what):` exclusive lock on `path`; `wait_s=0` refuses at once when held, else waits up
    to `wait_s` seconds (the commit lock). `what` says in the refusal what the holder is doing."""

    def __init__(self, path: str | Path, what: str, *, wait_s: float = 0.0) -> None:
        self.path, self.what, self.wait_s = Path(path), what, wait_s
        self._fd: int | None = None

    def acquire(self) -> FileLock:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:  # read-only cache, a file where a folder should be, no permission
                raise WriteError(self.path, e, f"cannot create the lock file of {self.what}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in _UNSUPPORTED:
                    raise ShardError(f"{self.path}: this filesystem does not support flock ({e.strerror}); writers "
                                     "could not exclude each other. Put the output on a filesystem with flock (on "
                                     "Lustre: mount with -o flock)") from e
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                raise LockHeldError(self._held_message()) from None
            try:  # the file we locked must still be the one at `path` (a releasing holder unlinks it)
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                    "command": " ".join(sys.argv[:1] + sys.argv[1:])[:300]}
            # written over, then cut to its length (a killed holder's longer description goes): not truncated to
            # 0 first, because ext4 (auto_da_alloc, its default) flushes a file truncated to 0 and rewritten when
            # it is closed, which made every release pay a disk write (measured 3-17 ms here, most of a cache
            # commit's time) for a file that is unlinked anyway (docs/dependencies.md, "ext4")
            data = json.dumps(info).encode()
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            self._fd = fd
            return self

    def _held_message(self) -> str:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            info = {}
        return (f"{self.path}: {self.what} is already running: held by {_describe(info)}. Wait for it to finish or "
                "stop it (scancel / kill that pid); a holder that was killed holds nothing, so just rerun then")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
