"""Which tokenizer made the rollouts: the check that it is the teacher's (or, across tokenizers, the configured
student's), and a cross-tokenizer task's two tokenizers (`CrossTokenizer`, `cross_tokenizers`, and the teacher's
kept in the cache, `store_teacher_tokenizer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import ConfigError
from pipeline.score.config import ScoreConfig
from pipeline.score.errors import ScoreInputError
from pipeline.store import align
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import tokenizer_mismatches
from pipeline.store.schema import check_arrow_schema
from pipeline.store.shards import ShardError


def check_rollout_tokenizer(paths: list[Path], teacher_tokenizer: str, teacher: Path,
                            student_tokenizer: str | None = None) -> None:
    """Refuse rollouts whose ids come from another tokenizer than the teacher's (or, cross-tokenizer, than the
    configured student tokenizer's), or that do not say which one: the same vocab size with another mapping passes
    the vocab-range check and poisons the cache silently."""
    if student_tokenizer is not None:
        wrong = [f"{p} ({fp})" for p, fp in tokenizer_mismatches(paths, student_tokenizer)]
        if wrong:
            raise ScoreInputError(
                f"{len(wrong)} rollout shard(s) were not tokenized by student_tokenizer ({student_tokenizer}): "
                f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}; point student_tokenizer at the folder of "
                "the tokenizer that made them")
        return
    for p in paths:
        try:
            schema = pq.read_schema(p)
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{p}: not a readable Parquet file ({e}); delete it and its .ok marker and rerun the "
                             "task that wrote it") from e
        check_arrow_schema(schema, "rollout", p)  # a newer schema major: refused before any teacher work
    wrong = tokenizer_mismatches(paths, teacher_tokenizer)
    other = [f"{p} ({fp})" for p, fp in wrong if fp is not None]
    unknown = [p for p, fp in wrong if fp is None]
    if other:
        raise ScoreInputError(
            f"{len(other)} rollout shard(s) were tokenized by another tokenizer than the teacher's ({teacher}: "
            f"{teacher_tokenizer}): {', '.join(other[:5])}{' ...' if len(other) > 5 else ''}; the teacher scores "
            "token ids, so rollouts must be tokenized with its tokenizer (the student's must be the same one), or "
            "scored across tokenizers: cross_tokenizer=true student_tokenizer=DIR (docs/architecture.md, "
            "\"Cross-tokenizer distillation\")"
        )
    if unknown:
        raise ScoreInputError(
            f"{len(unknown)} rollout shard(s) record no tokenizer fingerprint: {', '.join(map(str, unknown[:5]))}"
            f"{' ...' if len(unknown) > 5 else ''}; write them with `gkd import` / `gkd generate`, or through "
            "pipeline.store.rollouts.write_rollouts(..., tokenizer_fingerprint=tokenizer_fingerprint(TOKENIZER))"
        )


@dataclass
class CrossTokenizer:
    """A cross-tokenizer score task's two tokenizers (pipeline/store/align.py) and their fingerprints."""

    student: Any
    teacher: Any
    student_fp: str
    teacher_fp: str
    mismatched: list[str] = field(default_factory=list)  # "sample: why" of the rows that do not round-trip

    @property
    def key(self) -> tuple[str, str]:
        return (self.teacher_fp, self.student_fp)


def cross_tokenizers(cfg: ScoreConfig, tokenizer, tok_fp: str, teacher: Path) -> CrossTokenizer:
    """The student's tokenizer of a cross-tokenizer task, checked before any work: another tokenizer than the
    teacher's, and both decoding deterministically (store/align.py `check_decode`)."""
    from transformers import AutoTokenizer

    path = Path(cfg.student_tokenizer)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ConfigError(f"student_tokenizer: {path} holds no tokenizer (tokenizer.json); pass the student's model "
                          "or tokenizer folder")
    student = AutoTokenizer.from_pretrained(path)
    student_fp = tokenizer_fingerprint(student)
    if student_fp == tok_fp:
        raise ConfigError(f"cross_tokenizer=true, but student_tokenizer {path} is the teacher's tokenizer ({teacher}): "
                          "the rows would be plain same-tokenizer rows; drop cross_tokenizer and student_tokenizer")
    align.check_decode(student, f"student_tokenizer {path}")
    align.check_decode(tokenizer, f"teacher tokenizer {teacher}")
    return CrossTokenizer(student, tokenizer, student_fp, tok_fp)


def store_teacher_tokenizer(root: Path, tokenizer) -> None:
    """Keep the teacher's tokenizer in a cross-tokenizer cache (written once, staged and renamed): the trainer
    builds the vocabulary map from it and the student's, so the cache is enough without the teacher's folder."""
    import shutil
    import tempfile

    target = root / align.TEACHER_TOKENIZER
    if target.exists():
        return
    staged = Path(tempfile.mkdtemp(prefix=".teacher_tokenizer.", dir=root))
    try:
        tokenizer.save_pretrained(staged)
        staged.rename(target)
    except OSError:
        if not target.exists():  # another task won the race: theirs is the same tokenizer (the descriptor says)
            raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)
