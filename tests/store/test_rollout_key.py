"""`rollouts.rollout_key`: the score stage's content-key rule for a rollout row, which the on-policy driver's views
use too (onpolicy/state.py `rollout_keys`). Compared with what the score stage itself selects from a rollout shard
(`score/rows.select_rows`: the keys its rows are stored under, and the rows it skips as empty)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.score.config import ScoreConfig
from pipeline.score.rows import select_rows
from pipeline.store.fingerprint import content_key
from pipeline.store.rollouts import rollout_key, rollout_row, write_rollouts

VOCAB = 100


def _row(prompt: list[int], completion: list[int], teacher: list[int] | None = None, i: int = 0) -> dict:
    return rollout_row(prompt_id=f"p{i}", prompt_ids=prompt, completion_ids=completion, source="student",
                       policy_version=0, teacher_prompt_ids=teacher)


def _rows(score_prompt: bool) -> list[dict]:
    """Random rows with every case of the rule: empty prompts, empty completions, one-token rows, privileged
    teacher prompts (not with score_prompt, which refuses them), duplicates."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(60):
        prompt = rng.integers(3, VOCAB, int(rng.integers(0, 6))).tolist()
        completion = rng.integers(3, VOCAB, int(rng.integers(0, 6))).tolist()
        teacher = rng.integers(3, VOCAB, int(rng.integers(1, 6))).tolist() if i % 4 == 3 and not score_prompt else None
        rows.append(_row(prompt, completion, teacher, i))
    return rows + rows[:5]


@pytest.mark.parametrize("score_prompt", [False, True])
def test_the_keys_the_score_stage_selects(tmp_path, score_prompt):
    rows = _rows(score_prompt)
    path = tmp_path / "rollouts" / "r.parquet"
    path.parent.mkdir()
    write_rollouts(path, rows, tokenizer_fingerprint="tok")
    cfg = ScoreConfig(rollouts=str(path.parent), topk=8, score_prompt=score_prompt)
    counts: dict = {}
    selected = select_rows(cfg, [path], "fp", 0, VOCAB, 10**6, counts)
    keys = [rollout_key(r, "fp", 8, "raw_logprobs", score_prompt=score_prompt) for r in rows]
    assert sorted(r["key"] for r in selected) == sorted({k for k in keys if k is not None})  # one row per key
    assert counts.get("empty", 0) == sum(k is None for k in keys) > 0
    for row in selected:  # and stored as the key says: the x and P it hashes
        assert row["key"] == content_key("fp", row["input_ids"].astype(np.int64), row["first_scored"], 8, "raw_logprobs",
                                  teacher_prompt=row.get("teacher_prompt_ids"))


def test_rows_the_score_stage_skips_have_no_key_and_a_teacher_prompt_is_part_of_it():
    assert rollout_key(_row([5, 6], []), "fp", 8, "raw_logprobs") is None  # no completion
    assert rollout_key(_row([], [5, 6]), "fp", 8, "raw_logprobs") is None  # no context for the first token
    assert rollout_key(_row([], [5, 6]), "fp", 8, "raw_logprobs", score_prompt=True) is not None
    plain, opsd = _row([5, 6], [7, 8]), _row([5, 6], [7, 8], teacher=[9, 9, 5])
    assert rollout_key(plain, "fp", 8, "raw_logprobs") != rollout_key(opsd, "fp", 8, "raw_logprobs")
