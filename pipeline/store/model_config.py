"""Facts read from a model folder's config that more than one stage needs, read one way.

A vision-language model (Qwen-VL, Qwen3.5, LLaVA-style) keeps its language model's settings in `text_config`; a
text-only model has them at the top. The score stage (the teacher's vocabulary bounds the rollouts' ids and k), the
train stage's transformers backend (its probe ids) and `gkd cache import` (the teacher's vocabulary) all ask.
"""

from __future__ import annotations

from typing import Any


def vocab_size(config: Any) -> int:
    """The vocabulary of a model's config, a config.json dict or a transformers config object: its own
    `vocab_size`, else its text config's; 0 when neither has one."""
    if isinstance(config, dict):
        return int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 0)
    size = getattr(config, "vocab_size", None)
    if size is None and hasattr(config, "get_text_config"):
        size = config.get_text_config().vocab_size
    return int(size or 0)
