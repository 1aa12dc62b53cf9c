"""The on-policy run's state on disk, the on/off-policy schedule, and per-cycle training views of the cache.

    OUT/state.json                 {"cycle", "stage", "offpolicy_shards", "cycles": {c: {on_policy, done, ...}}}
    OUT/views/cycle-NNNN/          cache.json + shards/: exactly this cycle's scored rows (copied, still encoded)
    state.json "jobs"              Slurm executor only: "CYCLE:STAGE" (or "setup") -> the jobs submitted for it

state.json is rewritten atomically after every stage, so a killed run restarts at the first stage not recorded
as done. Each stage is also idempotent on its own (complete shards are kept, scored keys skipped, the trainer
resumes from its checkpoint), so a kill between a stage's work and the state write costs nothing but a check.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import pause
from pipeline.store import TeacherCache
from pipeline.store import images as image_store
from pipeline.store.align import TEACHER_TOKENIZER
from pipeline.store.cache import DESCRIPTOR, SHARDS
from pipeline.store.codec import concat_encoded
from pipeline.store.index import INDEX, rebuild
from pipeline.store.rollouts import iter_rollouts, rollout_key, rollout_shards
from pipeline.store.shards import atomic_write_bytes, is_complete, write_shard

STATE = "state.json"


def is_on_policy(seed: int, step: int, lmbda: float) -> bool:
    """The GKD draw of the reference trainers (ms-swift's and TRL's GKD trainers): on-policy iff Random(seed + step) < lmbda,
    taken at the first step of a cycle, so a rerun or a resumed run makes the same choices."""
    return random.Random(seed + step).random() < lmbda


def cycle_on_policy(cfg, cycle: int) -> bool:
    """Whether cycle `cycle` of the run `cfg` (an OnPolicyConfig) is on-policy: the draw at its first step."""
    return is_on_policy(cfg.seed, cycle * cfg.steps_per_generation, cfg.lmbda)


def policy_cycle(cfg, cycle: int) -> int:
    """The cycle whose start weights sample cycle `cycle`: exactly `max_staleness` cycles behind, fewer at the start
    (cycle.py: a fixed lag, so overlapped runs are deterministic)."""
    return max(0, cycle - cfg.max_staleness)


@dataclass
class State:
    cycle: int = 0
    stage: str = "export"
    setup_done: bool = False
    offpolicy_shards: list[str] = field(default_factory=list)  # frozen at setup: off-policy data never moves
    offpolicy_position: int = 0  # the trainer's sample position in the off-policy data, carried across cycles
    cycles: dict[str, dict] = field(default_factory=dict)  # per cycle: on_policy, done stages, stage timings
    jobs: dict[str, list[dict]] = field(default_factory=dict)  # Slurm executor: "CYCLE:STAGE" -> submitted jobs

    @classmethod
    def load(cls, out: Path) -> State:
        path = out / STATE
        return cls(**json.loads(path.read_text())) if path.exists() else cls()

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / STATE, json.dumps(asdict(self), indent=1, sort_keys=True).encode())
        pause.point("onpolicy-state")

    def info(self, cycle: int) -> dict:
        return self.cycles.setdefault(str(cycle), {"done": [], "seconds": {}})


# -- which scored rows belong to a set of rollouts ------------------------------------------------------------------


def rollout_keys(rollouts_dir: Path, cache: TeacherCache, prompt_order: Sequence[str] | None = None) -> list[str]:
    """The content keys the score stage gives these rollouts (the store's rule, `rollouts.rollout_key`), in
    the rows' order; with `prompt_order` (prompt ids) grouped by prompt in that order, each prompt's samples in
    their own order: what one unsharded generate task writes, however many shards the rollouts were written as."""
    d = cache.descriptor
    keys = []
    rows = iter_rollouts(rollout_shards(rollouts_dir))
    if prompt_order is not None:
        rank = {p: i for i, p in enumerate(prompt_order)}
        rows = iter(sorted(rows, key=lambda r: rank.get(r["prompt_id"], len(rank))))  # stable
    # a cross-tokenizer cache's keys cover both tokenizers (the score stage's CrossTokenizer.key)
    cross = (d.tokenizer_fingerprint, d.student_tokenizer_fingerprint) if d.cross_tokenizer else None
    for r in rows:
        key = rollout_key(r, d.teacher_fingerprint, d.k, d.key_mode, cross=cross)
        if key is not None:  # the rows the score stage skips as empty have no key
            keys.append(key)
    return list(dict.fromkeys(keys))


def build_view(cache: TeacherCache, keys: list[str], view: Path) -> tuple[list[str], int]:
    """Copy the rows with `keys` out of `cache` into the view cache at `view`, as one shard in the order of `keys`;
    returns its shard paths and the number of keys not found (e.g. skipped as overlong).

    Why a copy: the score stage writes only keys the cache lacks, so a sample that repeats an earlier cycle's (or
    the held-out set's) sequence lives in an older shard; neither the task marker's part list nor "all shards" is
    this cycle's data. Why one shard in key order: the trainer's data order is a function of the shards' layout
    (it shuffles row groups, then rows within windows), so the view must not inherit how the cache happens to be
    split: one score task (local executor) and an array of them (Slurm executor) then give the same view, hence
    the same training. Rows stay encoded: only the id column is re-indexed to the view's one id table
    (`codec.concat_encoded`), so the trainer reads bit-identical teacher rows.
    """
    shards = view / SHARDS
    dest = shards / "view.parquet"
    if (view / "complete").exists():
        done = dest.exists() and is_complete(dest, "scored", checksum=False)  # no shard: no key of the cycle was found
        return ([str(dest)] if done else []), int((view / "complete").read_text() or 0)
    wanted = pa.array(keys, pa.string())
    found: set[str] = set()
    parts, sources = [], []
    # only the shards the cache index says hold one of the keys are opened (not every shard's key column)
    idx = cache.index()
    hit = np.isin(idx.keys, np.asarray(keys, dtype="S32"))
    holders = sorted({int(s) for s in np.searchsorted(idx.row_starts, np.flatnonzero(hit), side="right") - 1})
    for src in [cache.shard_dir / f"{idx.names[s]}.parquet" for s in holders]:
        keys_col = pq.read_table(src, columns=["key"]).column("key")
        mask = pc.is_in(keys_col, value_set=wanted)
        if not pc.any(mask).as_py():
            continue
        table = pq.read_table(src).filter(mask)
        # a key lives in one shard of a verified cache; keep the first copy if two caches were merged by hand
        fresh = [k not in found for k in table.column("key").to_pylist()]
        table = table.filter(pa.array(fresh))
        found.update(table.column("key").to_pylist())
        if table.num_rows:
            footer = {k: v for k, v in (pq.read_schema(src).metadata or {}).items() if k.startswith(b"gkd.codec")}
            parts.append((table.replace_schema_metadata(None), footer))
            sources.append(str(src))
    if parts and not is_complete(dest, "scored", checksum=False):
        table, footer = concat_encoded(parts, where=str(view))
        rank = {k: i for i, k in enumerate(keys)}
        table = table.take(np.argsort([rank[k] for k in table.column("key").to_pylist()], kind="stable"))
        if "images" in table.column_names:  # the images the rows name, before the shard (the trainer reads them here)
            for h in sorted({h for im in table.column("images").to_pylist() if im for h in im}):
                image_store.put(view, image_store.read(cache.root, h))
        write_shard(dest, table, "scored", extra={"view_of": sources}, footer=footer)
    out = [str(dest)] if parts else []
    if cache.descriptor.cross_tokenizer and not (view / TEACHER_TOKENIZER).exists():
        # the trainer builds the vocabulary map from the cache's copy of the teacher's tokenizer (store/align.py)
        staged = view / f".{TEACHER_TOKENIZER}.partial"
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(cache.root / TEACHER_TOKENIZER, staged)
        staged.rename(view / TEACHER_TOKENIZER)
    view.mkdir(parents=True, exist_ok=True)  # also when no key of the cycle was found (no shard made it)
    hidden = cache.descriptor.hidden
    if hidden is not None and not (view / hidden["output_layer"]).exists():
        # a hidden-state cache's rows need its teacher output layer (store/hidden.py), named by the descriptor
        staged = view / f".{hidden['output_layer']}.partial"
        shutil.copyfile(cache.root / hidden["output_layer"], staged)
        staged.rename(view / hidden["output_layer"])
    if not (view / DESCRIPTOR).exists():
        cache.descriptor.write(view / DESCRIPTOR)
    if not (view / INDEX).exists():  # the trainer reads the view through its index
        rebuild(view, cache.descriptor)
    missing = len(set(keys) - found)
    atomic_write_bytes(view / "complete", str(missing).encode())  # written last: the view is final
    return out, missing
