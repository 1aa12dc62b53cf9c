"""The part writer: the score loop's engine outputs -> extracted, checked rows -> parts of `part_rows` rows, each
published into the cache (its images first) without the keys another writer published meanwhile."""

from __future__ import annotations

from pathlib import Path

from pipeline.score.config import ScoreConfig
from pipeline.score.extract import check_finite, extract
from pipeline.score.hidden import hidden_rows
from pipeline.score.writer import BatchWriter
from pipeline.store import TeacherCache
from pipeline.store import images as image_store


class Parts:
    """The writer's side of the score loop: engine outputs -> checked rows -> parts of `part_rows` rows. `parts`
    (the task's part names, prior ones first) and `counts` are the caller's, updated in place."""

    def __init__(self, cache: TeacherCache, name: str, parts: list[str], counts: dict, cfg: ScoreConfig,
                 teacher: Path | str, output_weight=None) -> None:
        self.cache, self.name, self.parts, self.counts, self.cfg, self.teacher = cache, name, parts, counts, cfg, teacher
        self.output_weight = output_weight  # teacher_rows=hidden: the teacher's output layer (score/hidden.py)
        self.pending: list[dict] = []
        # A part's encoding and commit lasts as long as ~50 batches' extraction: in a thread of its own (behind a
        # queue of one part, as arrays), so the batch queue keeps draining meanwhile instead of filling and holding
        # the engine for the whole commit. Serial (write_queue=0): inline.
        self.part_writer = BatchWriter(self.write, 1 if cfg.write_queue else 0)

    def add(self, item: tuple[list[dict], list]) -> None:
        batch, flats = item
        for r, flat in zip(batch, flats, strict=True):
            # engine positions engine_first.. = the stored rows first_scored.. (the same completion tokens)
            if self.output_weight is not None:  # per-token hidden states (score/hidden.py)
                got = hidden_rows(flat, r, self.output_weight, self.teacher, self.cfg)
            else:
                got = extract(flat, r["engine_ids"], r["engine_first"], self.cfg.topk)
                check_finite(got, r, self.teacher, self.cfg)
            self.pending.append({**r, **got})
        while len(self.pending) >= self.cfg.part_rows:
            self.part_writer.put(self.pending[: self.cfg.part_rows])
            self.pending = self.pending[self.cfg.part_rows :]

    def flush(self) -> None:
        if self.pending:
            self.part_writer.put(self.pending)
            self.pending = []

    def write(self, rows: list[dict]) -> None:
        """Encode and publish one part; its index is taken here, when the parts before it are written (a part whose
        keys another writer published meanwhile takes none)."""
        self.parts += _write_part(self.cache, self.name, len(self.parts), rows, self.counts, Path(self.cfg.rollouts))


def _write_part(cache: TeacherCache, name: str, index: int, rows: list[dict], counts: dict,
                image_root: Path) -> list[str]:
    """Publish one part without the keys another writer published meanwhile; [] when nothing was left."""
    part = f"{name}-p{index:04d}"
    for h in sorted({h for r in rows for h in (r.get("images") or ())}):  # the files before the rows that name them
        cache.add_image(image_store.read(image_root, h))
    info, dropped = cache.add_rows(part, rows, extra={"task": name})
    if dropped:
        counts["cached_meanwhile"] = counts.get("cached_meanwhile", 0) + dropped
    return [part] if info is not None else []
