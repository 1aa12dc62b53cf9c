"""Held-out evaluation shared by the demo and the on-policy driver: a plain transformers forward of an exported
student against cached teacher rows, independent of the trainer (Megatron) and of the engines (vLLM)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
    bin (the `tail` loss's divergence at beta=0, T=1). The student side is a plain transformers forward of the
    exported folder (`model` is the folder or an already loaded HF model): independent of Megatron and of vLLM.
    `keys=None` evaluates every row of the cache."""
    import torch

    from pipeline.store import read_cache

    model = load_hf(model) if isinstance(model, str | Path) else model
    total, tokens = 0.0, 0
    with torch.no_grad():
        for s in read_cache(cache_dir, keys=keys):
            ids = torch.as_tensor(s.input_ids[None], dtype=torch.long)
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)[s.first_scored - 1: len(s.input_ids) - 1]
            t_lp = torch.as_tensor(s.topk_logprobs, dtype=torch.float64)
            s_lp = logp.gather(1, torch.as_tensor(s.topk_ids, dtype=torch.long))
            t_tail = torch.as_tensor(s.tail_logprobs, dtype=torch.float64)
            s_tail = torch.log1p(-torch.exp(torch.logsumexp(s_lp, -1)).clamp(max=1 - 1e-12))
            p_tail = t_tail.exp()  # zero when the top-k holds all the mass: 0 * log 0 counts as 0
            kl = (t_lp.exp() * (t_lp - s_lp)).sum(-1) + torch.where(p_tail > 0, p_tail * (t_tail - s_tail), 0.0)
            total += float(kl.sum())
            tokens += kl.numel()
    return {"heldout_kl": total / max(tokens, 1), "heldout_tokens": tokens}
