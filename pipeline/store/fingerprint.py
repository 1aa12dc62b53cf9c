"""Fingerprints and content keys.

A teacher fingerprint hashes what determines its outputs: config.json and the bytes of every weight file (each
file's digest computed once per file state and kept in the fingerprint record, pipeline/store/weights.py). A
tokenizer fingerprint hashes the full token<->id mapping, the merges and the special-token ids, so two tokenizers
with the same vocab size but a different mapping never share a cache. Scored rows are keyed by content
(teacher, tokens, first scored position, k, mode), never by their order in a batch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import MissingInputError
from pipeline.store import weights

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
_CHUNK = 1 << 22
# How teacher_fingerprint is computed (the descriptor's `fingerprint_scheme`; a cache records the one it was made with):
#   1: one blake2b-128 stream over the canonical config, then each weight file's name, a NUL and its bytes (caches
#      of descriptor < 1.5; a stream cannot be split, so one thread reads every byte)
#   2: blake2b-128 over a scheme tag, the canonical config, then per weight file its name, a NUL and the sha256 of
#      its bytes: files hash in parallel, each digest is kept per file state, and sha256 runs 2.3x faster than
#      blake2b here (1.65 vs 0.73 GB/s on one core of this Xeon: OpenSSL's SHA extensions)
FINGERPRINT_SCHEMES = (1, 2)
FINGERPRINT_SCHEME = 2


def new_digest() -> hashlib._Hash:
    """The hash of every fingerprint here, of the served teacher's (score/served/probe.py) and of imported rows."""
    return hashlib.blake2b(digest_size=16)


def teacher_fingerprint(model_dir: str | Path, scheme: int = FINGERPRINT_SCHEME, *, rehash: bool = False) -> str:
    """Hash of config.json (canonical JSON) and the contents of all weight files, by sorted relative name, as
    `scheme` computes it (FINGERPRINT_SCHEMES). Weight digests come from the fingerprint record where a file's
    size, mtime and inode match it (`rehash`: read every byte anyway)."""
    return teacher_fingerprint_info(model_dir, scheme, rehash=rehash)[0]


def teacher_fingerprint_info(model_dir: str | Path, scheme: int = FINGERPRINT_SCHEME, *,
                             rehash: bool = False) -> tuple[str, dict]:
    """teacher_fingerprint and what it cost: {"hashed": files read, "reused": files taken from the record,
    "record": its path, "kept": whether it could be written}."""
    if scheme not in FINGERPRINT_SCHEMES:
        raise ValueError(f"fingerprint scheme {scheme} is not known to this code (knows {FINGERPRINT_SCHEMES})")
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    if not config.exists():
        raise MissingInputError(f"{model_dir}: no config.json; a teacher must be a Hugging Face model folder")
    canonical = json.dumps(json.loads(config.read_text()), sort_keys=True).encode()
    files = sorted({p for pat in WEIGHT_PATTERNS for p in model_dir.glob(pat)})
    if not files:
        raise MissingInputError(f"{model_dir}: no weight files ({', '.join(WEIGHT_PATTERNS)})")
    if scheme == 1:
        return weights.stream_digest(model_dir, files, canonical, rehash=rehash)
    per_file, info = weights.digests(model_dir, files, "sha256", rehash=rehash)
    h = new_digest()
    h.update(b"gkd teacher fingerprint 2|")
    h.update(canonical)
    for p in files:
        h.update(b"|" + p.name.encode() + b"\0" + per_file[p.name].encode())
    return h.hexdigest(), info


def _hash_files(h: Any, paths: list[Path]) -> None:
    """Each file's name, a NUL, then its bytes (streamed), in the given order."""
    for p in paths:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)


# What AutoTokenizer can load a tokenizer from: a fast tokenizer's tokenizer.json, or the files a slow one is built from
# (sentencepiece's tokenizer.model, BPE's vocab.json + merges.txt, WordPiece's vocab.txt, tiktoken's *.tiktoken).
# Without any, transformers fails with "You need to have sentencepiece or tiktoken installed to convert a slow
# tokenizer", which names neither the folder nor the missing files.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_tokenizer_files(model_dir: str | Path, role: str = "teacher") -> None:
    """Refuse a model folder that holds no tokenizer files, naming the folder and the files it needs."""
    model_dir = Path(model_dir)
    if model_dir.is_dir() and not any((model_dir / f).exists() for f in TOKENIZER_FILES) \
            and not any(model_dir.glob("*.tiktoken")):
        raise MissingInputError(
            f"{model_dir}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}, *.tiktoken); copy the "
            f"{role}'s tokenizer.json and tokenizer_config.json (or its tokenizer.model) from its model repository "
            "into the folder")


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of a Hugging Face fast tokenizer's vocab mapping, merges and added/special tokens with their ids.

    Accepts a tokenizer object or a folder (loaded with transformers.AutoTokenizer).
    """
    if isinstance(tokenizer, str | Path):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__}: only fast (Rust-backed) tokenizers can be fingerprinted")
    spec = json.loads(backend.to_str())
    model = spec.get("model", {})
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        vocab = sorted(vocab.items(), key=lambda kv: kv[1])
    merges = model.get("merges") or []
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    added = sorted((t["id"], t["content"], bool(t.get("special"))) for t in spec.get("added_tokens", []))
    special = sorted((name, getattr(tokenizer, f"{name}_id", None)) for name in ("bos_token", "eos_token", "pad_token", "unk_token"))
    h = new_digest()
    h.update(json.dumps({"type": model.get("type"), "vocab": vocab, "merges": merges, "added": added, "special": special}).encode())
    return h.hexdigest()


def content_key(teacher_fp: str, token_ids: Sequence[int] | np.ndarray, first_scored: int, k: int, mode: str,
                teacher_prompt: Sequence[int] | np.ndarray | None = None, images: Sequence[str] | None = None,
                cross: tuple[str, str] | None = None) -> str:
    """Key of one scored row: the same tokens scored by the same teacher the same way always get the same key.
    `teacher_prompt` (OPSD): the teacher saw these ids instead of token_ids[:first_scored]; it is part of the key,
    so the same completion scored with and without the privileged context are two rows (None: the plain key).
    `images`: the content hashes of the prompt's images (pipeline/store/images.py), in placeholder order: the same
    tokens with another image are another row (None or empty: a text-only key, unchanged). `cross` (a
    cross-tokenizer cache, store/align.py): (teacher tokenizer, student tokenizer) fingerprints; token_ids and
    first_scored are then the student's, whose text the teacher's tokenization is a function of."""
    h = new_digest()
    h.update(f"{teacher_fp}|{int(first_scored)}|{int(k)}|{mode}|".encode())
    h.update(np.ascontiguousarray(token_ids, dtype="<i4").tobytes())
    if teacher_prompt is not None:
        tp = np.ascontiguousarray(teacher_prompt, dtype="<i4")
        h.update(f"|teacher_prompt|{len(tp)}|".encode())
        h.update(tp.tobytes())
    if images:
        h.update(f"|images|{len(images)}|{','.join(images)}".encode())
    if cross is not None:
        h.update(f"|cross|{cross[0]}|{cross[1]}".encode())
    return h.hexdigest()


def adapter_fingerprint(base_fp: str, adapter_dir: str | Path) -> str:
    """A teacher that is a base model plus a peft LoRA adapter: the base's fingerprint, the adapter's config
    (canonical JSON) and the contents of its weight files."""
    adapter_dir = Path(adapter_dir)
    config = adapter_dir / "adapter_config.json"
    if not config.exists():
        raise MissingInputError(f"{adapter_dir}: no adapter_config.json; a teacher adapter must be a peft LoRA folder")
    files = sorted({p for pat in WEIGHT_PATTERNS for p in adapter_dir.glob(pat)})
    if not files:
        raise MissingInputError(f"{adapter_dir}: no adapter weight files ({', '.join(WEIGHT_PATTERNS)})")
    h = new_digest()
    h.update(f"adapter|{base_fp}|".encode())
    h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    _hash_files(h, files)
    return h.hexdigest()


def sample_id(prompt_id: str, prompt_ids: Sequence[int] | np.ndarray, completion_ids: Sequence[int] | np.ndarray,
              images: Sequence[str] | None = None) -> str:
    """Stable id of a rollout: its prompt id and its tokens (the split point matters, so both parts are hashed),
    and its images' hashes where it has any."""
    h = new_digest()
    p = np.ascontiguousarray(prompt_ids, dtype="<i4")
    h.update(f"{prompt_id}|{len(p)}|".encode())
    h.update(p.tobytes())
    h.update(np.ascontiguousarray(completion_ids, dtype="<i4").tobytes())
    if images:
        h.update(f"|images|{','.join(images)}".encode())
    return h.hexdigest()
