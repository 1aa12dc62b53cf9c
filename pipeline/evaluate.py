"""Held-out evaluation shared by the demo and the on-policy driver: a plain transformers forward of an exported
student against cached teacher rows, independent of the trainer (Megatron) and of the engines (vLLM)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import InputError
from pipeline.store import TeacherCache, read_cache


def load_hf(model_dir: str | Path) -> Any:
    """An HF folder, or a peft adapter folder (`gkd export --adapter-only`) put on its base and merged, in fp32."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    adapter = Path(model_dir) / "adapter_config.json"
    if not adapter.exists():
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(json.loads(adapter.read_text())["base_model_name_or_path"],
                                                dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(model_dir)).merge_and_unload().eval()


def heldout_kl(model: Any, cache_dir: str | Path, keys: list[str] | None = None) -> dict:
    """Mean KL(teacher || student) per scored token over the held-out rows, on the teacher's top-k plus one tail
    bin: the trainer's `tail` loss at beta=0, T=1, with the same teacher bins (the stored top-k and tail,
    `pipeline.train.losses.reference.teacher_bins`). The student side is a plain transformers forward of the exported folder
    (`model` is the folder or an already loaded HF model), in float64: independent of Megatron and of vLLM.
    Also the top-1 agreement: the fraction of those positions where the student's most likely next token (argmax
    over its full vocab) is the teacher's (its rank-1 id). `keys=None` evaluates every row of the cache. A top-p
    cache's bins are each position's kept entries plus its tail; a k = 0 cache has no teacher distribution to
    compare with and is refused."""
    import torch

    from pipeline.train.losses.reference import divergence, student_bins, teacher_bins

    if TeacherCache.open(cache_dir).descriptor.k == 0:
        raise InputError(f"{cache_dir}: a k = 0 cache holds only the actual tokens' teacher logprobs; held-out KL "
                         "needs a top-k cache (score the held-out rows with --topk >= 1)")
    model = load_hf(model) if isinstance(model, str | Path) else model
    total, tokens, agree = 0.0, 0, 0
    with torch.no_grad():
        for s in read_cache(cache_dir, keys=keys):
            ids = torch.as_tensor(s.input_ids[None], dtype=torch.long)
            z = model(ids).logits[0].double()[s.first_scored - 1: len(s.input_ids) - 1]  # logits at t predict t+1
            top = torch.as_tensor(s.topk_ids, dtype=torch.long)
            # a top-p cache: only each position's kept entries are bins (the padding after them is not)
            valid = None if s.topk_counts is None else torch.arange(top.shape[1]) < torch.as_tensor(s.topk_counts)[:, None]
            # the student's mass outside the teacher's (kept) top-k: -inf onto those ids, +inf (a no-op) elsewhere
            fill = torch.full(top.shape, -torch.inf, dtype=z.dtype) if valid is None else \
                torch.where(valid, -torch.inf, torch.inf).to(z.dtype)
            lse_rest = z.scatter_reduce(1, top, fill, "amin").logsumexp(-1)
            a = teacher_bins(torch.as_tensor(s.topk_logprobs), torch.as_tensor(s.tail_logprobs), valid, 1.0, "tail")
            kl = divergence(a, student_bins(z.gather(1, top), lse_rest, valid, 1.0, "tail"), 0.0, valid, "tail")
            total += float(kl.sum())
            tokens += kl.numel()
            agree += int((z.argmax(-1) == top[:, 0]).sum())
    return {"heldout_kl": total / max(tokens, 1), "heldout_tokens": tokens, "top1_agreement": agree / max(tokens, 1)}
