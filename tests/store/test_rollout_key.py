"""`rollouts.rollout_key`: the score stage's content-key rule for a rollout row, which the on-policy driver's views
use too (onpolicy/state.py `rollout_keys`)."""

from __future__ import annotations

import numpy as np

from pipeline.store.fingerprint import content_key
from pipeline.store.rollouts import rollout_key, rollout_row


def _row(prompt: list[int], completion: list[int], teacher: list[int] | None = None) -> dict:
    return rollout_row(prompt_id="p", prompt_ids=prompt, completion_ids=completion, source="student",
                       policy_version=0, teacher_prompt_ids=teacher)


def test_the_rule_the_driver_used_before_for_rows_with_a_prompt_and_a_completion():
    rng = np.random.default_rng(0)
    for _ in range(20):
        r = _row(rng.integers(3, 99, int(rng.integers(1, 9))).tolist(), rng.integers(3, 99, int(rng.integers(1, 9))).tolist())
        ids = np.asarray(r["prompt_ids"] + r["completion_ids"], dtype=np.int64)
        assert rollout_key(r, "fp", 8, "raw_logprobs") == content_key("fp", ids, len(r["prompt_ids"]), 8, "raw_logprobs")


def test_rows_the_score_stage_skips_have_no_key_and_a_teacher_prompt_is_part_of_it():
    assert rollout_key(_row([5, 6], []), "fp", 8, "raw_logprobs") is None  # no completion
    assert rollout_key(_row([], [5, 6]), "fp", 8, "raw_logprobs") is None  # no context for the first token
    assert rollout_key(_row([], [5, 6]), "fp", 8, "raw_logprobs", score_prompt=True) is not None
    plain, opsd = _row([5, 6], [7, 8]), _row([5, 6], [7, 8], teacher=[9, 9, 5])
    assert rollout_key(plain, "fp", 8, "raw_logprobs") != rollout_key(opsd, "fp", 8, "raw_logprobs")
