"""A served teacher's identity: a remote teacher's weights cannot be hashed. Its fingerprint is the served model name
plus the teacher's logprobs of a fixed probe sequence (`probe_ids`), each rounded to PROBE_QUANTUM nat, so a
different model behind the same URL and name gets another fingerprint; a vision-language teacher's probe is scored
a second time with a fixed synthetic image (`probe_image`) in the middle, so another vision tower gets another
fingerprint too. Rounding alone would let float noise near a rounding boundary flip a value, so the raw probe is
also recorded in cache.json (`teacher_probe`) and a later run against that cache compares its own probe to it
within PROBE_TOLERANCE instead (`reconcile_probe`): within it, the run takes the cache's fingerprint; outside it,
the run is refused before the cache is touched."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from pipeline.store.cache import DESCRIPTOR, CacheMismatchError, Descriptor
from pipeline.store.fingerprint import new_digest

PROBE_LEN = 32
# The probe's logprobs are rounded to this step in the fingerprint: coarse enough that a server's float noise
# (fp32 on CPU: ~1e-5 nat between batch compositions; bf16 on GPU: up to ~1e-2) rarely crosses a step, fine
# enough that another model (another seed, another fine-tune) changes some of the 31 values.
PROBE_QUANTUM = 0.1
# A cache's recorded probe and the server's agree when every value is within this (half a rounding step): the
# same server restarted, or another replica, passes; another model does not (its values move by O(1) nat).
PROBE_TOLERANCE = 0.05
PROBE_IMAGE = "synthetic-56x56-v1"  # the probe image's name in the fingerprint: change it when probe_image changes


def probe_ids(vocab_size: int) -> list[int]:
    """The fixed probe sequence: PROBE_LEN ids spread over the vocabulary by a fixed multiplicative step (no
    randomness, so every run and every machine sends the same ids)."""
    return [(7 + 7919 * i) % vocab_size for i in range(PROBE_LEN)]


def probe_image() -> bytes:
    """The vision-language probe's image: 56x56 px (Qwen-VL's default min_pixels, so no processor enlarges it)
    of a fixed pattern, as PNG; the same bytes on every run and machine."""
    from PIL import Image

    y, x, c = np.mgrid[0:56, 0:56, 0:3]
    pixels = ((x * 7 + y * 13 + c * 101 + (x * y) % 17) % 256).astype(np.uint8)
    return png_bytes(Image.fromarray(pixels, "RGB"))


def png_bytes(image) -> bytes:
    """A decoded image as PNG (lossless: the server decodes exactly these pixels)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def probe_fingerprint(model: str, ids: list[int], logprobs: list[float], image: str | None = None) -> str:
    """The served teacher's fingerprint: name, probe ids and the probe's actual-token logprobs in PROBE_QUANTUM steps
    (a vision-language teacher's: `image` names the probe image, whose positions' logprobs follow the text's)."""
    h = new_digest()
    steps = [round(v / PROBE_QUANTUM) for v in logprobs]
    h.update(f"served|{model}|{json.dumps(ids)}|{PROBE_QUANTUM}|{json.dumps(steps)}".encode())
    if image is not None:
        h.update(f"|image|{image}".encode())
    return h.hexdigest()


def reconcile_probe(cache_root: str | Path, fingerprint: str, probe: dict) -> str:
    """The teacher fingerprint to score under, checked against an existing cache before it is touched (read only):
    the cache's own fingerprint when its recorded probe agrees with the server's within PROBE_TOLERANCE; this
    run's otherwise (a new cache, or one whose descriptor check will name the mismatch). Another model behind the
    same URL and name is refused here, naming both fingerprints."""
    path = Path(cache_root) / DESCRIPTOR
    if not path.exists():
        return fingerprint
    cached = Descriptor.read(path)
    recorded = cached.teacher_probe
    if recorded is None or cached.teacher_fingerprint == fingerprint:
        return fingerprint  # an in-process cache: Descriptor.mismatches names the two fingerprints
    old_ids, new_ids = json.loads(recorded["ids"]), json.loads(probe["ids"])
    old_lp = np.asarray(json.loads(recorded["logprobs"]), np.float64)
    new_lp = np.asarray(json.loads(probe["logprobs"]), np.float64)
    why = None
    if recorded.get("model") != probe["model"]:
        why = f"the cache's teacher was served as {recorded.get('model')!r}, this server serves {probe['model']!r}"
    elif old_ids != new_ids or old_lp.shape != new_lp.shape:
        why = "the cache's probe sequence differs from this run's (another vocabulary size?)"
    else:
        dev = np.abs(old_lp - new_lp)
        if np.all(dev <= PROBE_TOLERANCE):
            return cached.teacher_fingerprint
        i = int(np.argmax(dev))
        why = (f"its logprobs of the probe sequence differ from the cache's by up to {dev[i]:.3f} nat (position "
               f"{i + 1}: {new_lp[i]:.4f} vs {old_lp[i]:.4f}; the same teacher agrees within {PROBE_TOLERANCE})")
    raise CacheMismatchError(
        f"{path}: the served teacher is not the one this cache was scored with: {why}. Cache's teacher fingerprint "
        f"{cached.teacher_fingerprint} ({cached.teacher}), the server's {fingerprint}. Nothing was written; serve "
        "the cache's teacher again, or score this one into another --cache")
