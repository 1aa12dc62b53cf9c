"""The score stage's own refusals of its input and of the teacher's output (both user errors: the message names the
sample and the fix)."""

from __future__ import annotations

from pipeline.errors import UserError


class ScoreInputError(UserError, ValueError):
    """Bad rollouts: the message names the samples and the fix."""


class TeacherOutputError(UserError, ValueError):
    """The engine returned logprobs that cannot be stored (NaN, inf): the message names the sample and the fix."""
