"""Images of multimodal rollouts and caches: stored once, content-addressed, beside the shards that name them.

    ROLLOUTS/images/<hash>    the bytes of an image as given (PNG, JPEG, ...), hash = blake2b-128 hex of them
    CACHE/images/<hash>       the same file, copied in by `gkd score` before the part that names it is published

A rollout row lists the hashes of its prompt's images in the order of their placeholders (`images`, rollout schema
1.3; scored schema 1.2), and the content key covers them (`fingerprint.content_key`): the same text with another
image is another sample, and a file changed behind the store no longer matches its name, so reading it is refused
(`read`) instead of being taken for the cached one.

In the token ids an image is a run of the model's `image_token_id` (Qwen-VL, Qwen3.5, LLaVA-style processors expand
one placeholder per image to as many tokens as the image has patches): the student's processor made the run, and
vLLM expands one placeholder with the teacher's processor, so `collapse` gives vLLM the one-placeholder form and the
score stage compares vLLM's expansion with the stored one, sample by sample (pipeline/score/teacher.py
`check_expansion`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import UserError

IMAGE_DIR = "images"


class ImageError(UserError, ValueError):
    """A missing, unreadable, changed or corrupt image: the message names the file (and the sample) and the fix."""


def image_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def image_dir(root: str | Path) -> Path:
    """The image store of a rollout folder or a cache root."""
    return Path(root) / IMAGE_DIR


def put(root: str | Path, data: bytes) -> str:
    """Store an image's bytes once under `root/images/` (atomic: a temporary file renamed into place) and return its
    hash; an image already there is not written again."""
    digest = image_hash(data)
    path = image_dir(root) / digest
    if path.exists() and path.stat().st_size == len(data):
        return digest
    path.parent.mkdir(parents=True, exist_ok=True)
    with _writing(Path(root)):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{digest}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return digest


# Temporaries of a killed writer: image writers of one store are not serialised (score tasks of an array write their
# parts' images concurrently, outside the cache's commit lock), so a temporary may be a live writer's. Each `put`
# holds a shared flock on ROOT/.images.lock while its temporary exists; `remove_stale_temporaries` removes them only
# when it gets the exclusive lock at once, i.e. when no put is under way anywhere (the kernel drops a killed
# writer's lock), and otherwise leaves them to a later writer. The lock file sits beside images/, not in it, so a
# listing of the store holds images only.
WRITERS_LOCK = ".images.lock"


@contextlib.contextmanager
def _writing(root: Path) -> Iterator[None]:
    try:
        fd = os.open(root / WRITERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only store fails at the write below, with its own message
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:  # no flock on this filesystem: write unlocked; the clean-up then never runs here
            pass
        yield
    finally:
        os.close(fd)


def remove_stale_temporaries(root: str | Path) -> int:
    """Remove the temporaries killed writers left in `root/images/` when no writer is under way (see WRITERS_LOCK);
    returns how many (0 also when a writer holds the lock)."""
    root = Path(root)
    if not image_dir(root).is_dir():
        return 0
    try:
        fd = os.open(root / WRITERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a put is under way (or no flock): its temporary is not stale
        os.close(fd)
        return 0
    try:
        stale = list(image_dir(root).glob(".*.tmp"))
        for t in stale:
            t.unlink(missing_ok=True)
        return len(stale)
    finally:
        os.close(fd)


def stored(root: str | Path) -> bool:
    """Whether `root/images/` holds an image (a dot-named temporary does not count): what says, without reading a
    shard, that a rollout folder or a cache may hold image rows (`gkd score` copies an image in before the part that
    names it is published, so a cache with image rows always has one; the rows confirm it, train/data/sources.py)."""
    try:
        with os.scandir(image_dir(root)) as entries:
            return any(not e.name.startswith(".") for e in entries)
    except (FileNotFoundError, NotADirectoryError):
        return False


def read(root: str | Path, digest: str, *, sample: str = "") -> bytes:
    """The bytes of image `digest` from `root/images/`, checked against their name."""
    path = image_dir(root) / digest
    where = f" (sample {sample})" if sample else ""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ImageError(f"{path}: image{where} is missing; copy the rollouts' images/ folder along with their "
                         "shards, or re-create the rollouts") from None
    except OSError as e:
        raise ImageError(f"{path}: image{where} is unreadable ({e.strerror}); fix its permissions") from None
    if image_hash(data) != digest:
        raise ImageError(f"{path}: image{where} was changed after it was stored (its bytes no longer hash to its "
                         "name); restore it, or re-import the rollouts so that the new image gets its own key")
    return data


def decode(data: bytes, where: str) -> Any:
    """The image as an RGB `PIL.Image`, fully decoded (a truncated or corrupt file is refused here, not later)."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        # PIL's own text of an unknown format names only the in-memory buffer (<_io.BytesIO object at 0x...>)
        why = "no image format PIL knows" if isinstance(e, UnidentifiedImageError) else str(e)
        raise ImageError(f"{where}: not a readable image ({why}); replace the file with a PNG or JPEG") from None


def load(root: str | Path, digests: Sequence[str], *, sample: str = "") -> list[Any]:
    """The decoded images of one sample, in placeholder order."""
    return [decode(read(root, d, sample=sample), f"{image_dir(root) / d} (sample {sample})") for d in digests]


def runs(ids: np.ndarray | Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `image_token_id` in `ids`: one run per image."""
    ids = np.asarray(ids)
    hit = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [(int(s), int(e - s)) for s, e in zip(edges[::2], edges[1::2], strict=True)]


def collapse(ids: np.ndarray | Sequence[int], image_token_id: int) -> list[int]:
    """`ids` with each run of `image_token_id` cut to one token: the prompt vLLM expands with the teacher's processor."""
    ids = np.asarray(ids)
    keep = np.ones(len(ids), bool)
    keep[1:] = ~((ids[1:] == image_token_id) & (ids[:-1] == image_token_id))
    return ids[keep].tolist()


def image_token_id(config: dict) -> int | None:
    """The placeholder token of a vision-language model's config.json (None: a text-only model)."""
    if not config.get("vision_config"):
        return None
    for key in ("image_token_id", "image_token_index"):
        if config.get(key) is not None:
            return int(config[key])
    return None
