"""The in-process teacher: its folder (`resolve_teacher`), its vLLM engine (`engine_length`, `teacher_engine_args`,
`open_teacher_engine`: the one rule `gkd score` and the on-policy driver share) and the score loop's engine around
it (`InProcessTeacher`), with the check that the engine expanded a rollout's images as the rollout holds them
(`check_expansion`, which a served teacher applies to its server's answers too)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import assets
from pipeline.config import ConfigError
from pipeline.engine import ARRAY_LOGPROBS_FLAG, EngineArgs, array_prompt_logprobs, open_engine
from pipeline.score.adapter import merged_teacher
from pipeline.score.config import DTYPES, ScoreConfig
from pipeline.score.errors import TeacherOutputError
from pipeline.store import images as image_store
from pipeline.store.fingerprint import check_tokenizer_files


def resolve_teacher(name: str | Path | None) -> Path:
    """The score stage's teacher folder (`default` / null: the embedded one, pipeline.assets), checked to be one."""
    path = assets.resolve_teacher(name)
    if not (path / "config.json").exists():
        raise ConfigError(f"teacher: {path} is not a Hugging Face model folder (no config.json)")
    check_tokenizer_files(path)
    return path


class InProcessTeacher:
    """The score loop's engine for a vLLM `LLM` in this process: one `generate` call per token batch."""

    def __init__(self, llm, k: int, *, image_root: Path | None = None, image_token: int | None = None,
                 arrays: bool = True) -> None:
        from vllm import SamplingParams

        self.llm = llm
        # Prompt logprobs as the engine core's arrays, not Python lists (pipeline/engine.py): vLLM's pythonising
        # would cost more than all of this stage's own work behind a fast teacher.
        extra = {ARRAY_LOGPROBS_FLAG: True} if arrays and array_prompt_logprobs() else None
        self.params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False, flat_logprobs=True,
                                     extra_args=extra)
        self.image_root, self.image_token = image_root, image_token

    def score_batches(self, batches: Iterable[list[dict]]) -> Iterator[tuple[list[dict], list]]:
        """Each batch with its rows' flat prompt logprobs (vLLM's FlatLogprobs), in order. A row with images goes
        to vLLM with one placeholder per image and the pixels (`multi_modal_data`); vLLM expands the placeholders
        with the teacher's processor, and that expansion must be the rollout's, token for token."""
        from vllm.inputs import TokensPrompt

        for batch in batches:
            prompts = []
            for r in batch:
                if r.get("images"):
                    pixels = image_store.load(self.image_root, r["images"], sample=r["sample_id"])
                    prompts.append(TokensPrompt(prompt_token_ids=image_store.collapse(r["engine_ids"], self.image_token),
                                                multi_modal_data={"image": pixels}))
                else:
                    prompts.append(TokensPrompt(prompt_token_ids=r["engine_ids"].tolist()))
            outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
            for r, out in zip(batch, outputs, strict=True):
                if r.get("images"):
                    check_expansion(r, out.prompt_token_ids, self.image_token)
            yield batch, [out.prompt_logprobs for out in outputs]


def check_expansion(row: dict, teacher_ids: Sequence[int], image_token: int, by: str = "engine") -> None:
    """The teacher engine's sequence (its processor's expansion of the images) against the stored one; `by` names
    who expanded them (the in-process engine, or a served teacher's server)."""
    ours = np.asarray(row["engine_ids"])
    theirs = np.asarray(list(teacher_ids))
    if len(ours) == len(theirs) and np.array_equal(ours, theirs):
        return
    mine = [n for _, n in image_store.runs(ours, image_token)]
    seen = [n for _, n in image_store.runs(theirs, image_token)]
    raise TeacherOutputError(
        f"sample {row['sample_id']}: the teacher's {by} expanded its images to {seen} placeholder tokens "
        f"({len(theirs)} tokens in all), the rollout holds {mine} ({len(ours)}): the student's and the teacher's "
        "processors differ (version, max_pixels/min_pixels, template); nothing of this part was written")


@contextlib.contextmanager
def in_process_teacher(cfg: ScoreConfig, teacher: Path, llm, engine_len: int, *, image_token: int | None = None,
                        max_images: int = 0) -> Iterator[InProcessTeacher]:
    """The engine handed in, or one opened on the teacher (merged with its adapter first, if any) and closed after."""
    vision = {"image_root": Path(cfg.rollouts), "image_token": image_token}
    if llm is not None:
        yield InProcessTeacher(llm, cfg.topk, **vision)
        return

    with contextlib.ExitStack() as stack:
        model_dir = teacher
        if cfg.teacher_adapter:
            model_dir = stack.enter_context(merged_teacher(teacher, cfg.teacher_adapter, dtype=DTYPES[cfg.dtype],
                                                           parent=cfg.merge_dir))
        engine = stack.enter_context(open_teacher_engine(cfg, model_dir, engine_len, max_images=max_images))
        yield InProcessTeacher(engine, cfg.topk, **vision)


def engine_length(cfg: ScoreConfig, teacher_config: Any) -> int:
    """The engine's max_model_len for scoring sequences of up to `cfg.max_model_len` tokens. vLLM must fit one
    sampled token after the scored sequence, so the engine gets max_model_len + 1 where the model's positions allow
    it: a sequence of exactly max_model_len tokens is then scorable."""
    text_config = teacher_config.get_text_config() if hasattr(teacher_config, "get_text_config") else teacher_config
    max_pos = int(getattr(text_config, "max_position_embeddings", cfg.max_model_len + 1) or cfg.max_model_len + 1)
    return min(cfg.max_model_len + 1, max_pos)


def teacher_engine_args(cfg: ScoreConfig, model_dir: str | Path, engine_len: int, *, max_images: int = 0) -> EngineArgs:
    """The in-process teacher engine of a score config: the one rule `gkd score` and the on-policy driver share.
    `max_images` > 0 (or the config's max_images_per_prompt): a vision-language teacher's `limit_mm_per_prompt`."""
    images = cfg.max_images_per_prompt or max_images
    return EngineArgs(
        model=str(model_dir),
        tensor_parallel_size=cfg.tensor_parallel_size,
        dtype=cfg.dtype,
        max_model_len=engine_len,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_gib=cfg.kv_cache_gib,
        max_num_batched_tokens=cfg.max_num_batched_tokens or max(cfg.batch_tokens, engine_len),
        enforce_eager=cfg.enforce_eager,
        extra={**cfg.engine_extra, **({"limit_mm_per_prompt": {"image": images}} if images else {})},
    )


def open_teacher_engine(cfg: ScoreConfig, model_dir: str | Path, engine_len: int, *, max_images: int = 0):
    """A context manager: the teacher engine of `cfg`, with the logprob settings scoring needs (max_logprobs = k)."""
    return open_engine(teacher_engine_args(cfg, model_dir, engine_len, max_images=max_images),
                       max_logprobs=cfg.topk, logprobs_mode=cfg.logprob_mode)
