"""Hidden-state caches (`gkd score teacher_rows=hidden`): the exact teacher on disk.

Per scored position j the row stores the teacher's final hidden state h_{j-1} (after its final norm: what its
output layer reads; the hidden state at position j - 1 is the one that predicts token j), in bf16 (or float32),
and the cache stores the teacher's output layer W [V, H] once, `CACHE/output_layer.safetensors`; the teacher's
logits of token j are then exactly h_{j-1} · Wᵀ, so the trainer computes the full-vocabulary teacher distribution at
any temperature, chunk by chunk (pipeline/train/losses/exact.py). Only teachers whose logits are that plain linear
map are accepted (`nonlinear_logits`): a final logit soft-cap, a logit scale or an output bias is refused by name.

The rows are otherwise ordinary scored rows (schemas/scored.json 1.4): the k = 0 codec columns hold the actual
token's teacher rank and logprob (OPD reads them), `hidden_states` holds the bytes of [num_scored, H] little-endian
values. cache.json records the kind (`teacher_rows: hidden`) and `hidden` (dtype, size, the output layer's file and
sha256, the route that produced the rows); a cache is one kind or the other (Descriptor.IDENTITY).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from pipeline.config import ConfigError
from pipeline.store.shards import ShardError

KIND = "hidden"  # Descriptor.teacher_rows of a hidden-state cache (None: a top-k cache)
COLUMN = "hidden_states"
OUTPUT_LAYER = "output_layer.safetensors"
DTYPES = {"bfloat16": 2, "float32": 4}  # stored dtype -> bytes per value
# config.json keys that make the logits something other than hidden · Wᵀ (value meaning "off" for each)
# (Gemma 2/3: tanh soft-cap; Cohere: logits × logit_scale; Granite: logits / logits_scaling)
NONLINEAR_KEYS = {"final_logit_softcapping": (None, 0, 0.0), "logit_scale": (None, 1, 1.0),
                  "logits_scaling": (None, 1, 1.0)}


def key_mode(logprob_mode: str, dtype: str) -> str:
    """The logprob-mode part of a hidden row's content key: the same tokens scored into a top-k cache and into a
    hidden-state cache are two rows."""
    return f"{logprob_mode}+hidden:{dtype}"


def nonlinear_logits(config: dict) -> list[str]:
    """The config.json keys (top level or text_config) that make a teacher's logits other than hidden · Wᵀ."""
    out = []
    for where, cfg in (("", config), ("text_config.", config.get("text_config") or {})):
        for key, off in NONLINEAR_KEYS.items():
            if key in cfg and cfg[key] not in off:
                out.append(f"{where}{key}={cfg[key]!r}")
    return out


def check_teacher(teacher: Path) -> None:
    """Refuse, before any work, a teacher whose logits are not a plain linear map of its last hidden state."""
    config = json.loads((teacher / "config.json").read_text())
    if bad := nonlinear_logits(config):
        raise ConfigError(
            f"{teacher}/config.json: {', '.join(bad)}: this teacher's logits are not a linear map of its last hidden "
            "state (hidden · Wᵀ), so a hidden-state cache cannot reproduce them; score it with teacher_rows=topk")


def _weight_files(teacher: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = teacher / "model.safetensors.index.json"
    if index.is_file():
        return {k: teacher / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    out = {}
    for f in sorted(teacher.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update(dict.fromkeys(st.keys(), f))
    return out


def output_layer(teacher: Path):
    """The teacher's output layer weight [V, H] as a torch tensor in its stored dtype: `lm_head.weight`, or the
    input embedding where the config ties them. An output bias is refused (not a plain linear map)."""
    from safetensors import safe_open

    files = _weight_files(teacher)
    config = json.loads((teacher / "config.json").read_text())
    if any(k.endswith("lm_head.bias") for k in files):
        raise ConfigError(f"{teacher}: its output layer has a bias (lm_head.bias): the logits are not hidden · Wᵀ; "
                          "score it with teacher_rows=topk")
    names = [k for k in files if k.endswith("lm_head.weight")]
    tied = config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", False))
    if not names and tied:
        names = [k for k in files if k.endswith("embed_tokens.weight")]
    if len(names) != 1:
        raise ConfigError(f"{teacher}: no single output layer weight among its safetensors files (found "
                          f"{names or 'none'} for lm_head.weight / a tied embed_tokens.weight); teacher_rows=hidden "
                          "needs an HF folder with safetensors weights")
    with safe_open(files[names[0]], "pt") as st:
        return st.get_tensor(names[0]).contiguous()


def output_layer_bytes(weight) -> bytes:
    from safetensors.torch import save

    return save({"weight": weight.contiguous()})


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_output_layer(root: Path, descriptor):
    """A hidden-state cache's output layer [V, H], its size and sha256 checked against cache.json."""
    from safetensors.torch import load

    path = Path(root) / OUTPUT_LAYER
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ShardError(f"{path}: cannot read the hidden-state cache's output layer ({e}); rescore into a new "
                         "cache") from e
    want = (descriptor.hidden or {}).get("output_layer_sha256")
    if want and sha256(data) != want:
        raise ShardError(f"{path}: sha256 differs from {Path(root) / 'cache.json'} (hidden.output_layer_sha256): "
                         "replaced or corrupted; restore it or rescore into a new cache")
    return load(data)["weight"]


def encode(hidden, dtype: str) -> bytes:
    """[n, H] torch tensor -> the column's bytes (little-endian `dtype`)."""
    import torch

    if dtype == "bfloat16":
        return hidden.to(torch.bfloat16).contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
    return hidden.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()


def decode(data: bytes, n: int, size: int, dtype: str) -> np.ndarray:
    """The column's bytes -> [n, size] numpy (bf16 as its int16 bit pattern: `as_torch` views it back)."""
    arr = np.frombuffer(data, "<i2" if dtype == "bfloat16" else "<f4")
    if arr.size != n * size:
        raise ValueError(f"{COLUMN} holds {arr.size} values, expected num_scored {n} x hidden size {size}")
    return arr.reshape(n, size)


def as_torch(arr: np.ndarray, dtype: str):
    """Decoded values -> a torch tensor of the stored dtype (bf16 from its bit pattern, no copy)."""
    import torch

    t = torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else arr.copy())
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def stats(descriptor, scored_tokens: int, nbytes: int) -> dict:
    """What `gkd cache stats` adds for a hidden-state cache: bytes per position, and what the cache can train."""
    h = descriptor.hidden or {}
    raw = int(h.get("size", 0)) * DTYPES.get(h.get("dtype", "bfloat16"), 2)
    return {"teacher_rows": KIND, "hidden_size": int(h.get("size", 0)), "hidden_dtype": h.get("dtype"),
            "raw_hidden_bytes_per_position": raw,
            "trains": "exact full-vocabulary loss=gkd (forward KL beta=0, reverse KL beta=1, JSD(beta)) at any "
                      "temperature, loss=opd, sft_alpha; every top-k loss through topk_from_hidden=K; "
                      "same-vocabulary students only, TP/CP/PP 1"}


TOPK_TRAINS = ("loss=gkd (topk_mode tail|renorm, at the temperature's treatment of the stored top-k), loss=opd, "
               "sft_alpha")


def verify_problems(root: Path, descriptor) -> list[str]:
    """`gkd cache verify` for a hidden-state cache's output layer: there, and the bytes cache.json names."""
    path = Path(root) / OUTPUT_LAYER
    if not path.is_file():
        return [f"{path}: missing (a hidden-state cache stores its teacher's output layer once); rescore into a new "
                "cache"]
    want = (descriptor.hidden or {}).get("output_layer_sha256")
    got = sha256(path.read_bytes())
    return [] if got == want else [f"{path}: sha256 {got} differs from cache.json's hidden.output_layer_sha256 "
                                   f"{want}; restore it or rescore into a new cache"]


def shard_problems(path: Path, descriptor) -> list[str]:
    """Each row's hidden_states holds num_scored x hidden size values of the cache's dtype."""
    import pyarrow.parquet as pq

    h = descriptor.hidden or {}
    size, width = int(h.get("size", 0)), DTYPES.get(h.get("dtype"), 0)
    t = pq.read_table(path, columns=["num_scored", COLUMN])
    bad = [i for i, (n, b) in enumerate(zip(t.column("num_scored").to_pylist(), t.column(COLUMN).to_pylist(),
                                             strict=True)) if b is None or len(b) != n * size * width]
    return [f"{path}: row {bad[0]} ({len(bad)} row(s)): {COLUMN} does not hold num_scored x {size} {h.get('dtype')} "
            "values; rescore these rows"] if bad else []
