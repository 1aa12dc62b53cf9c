"""Score stage, the library: rollouts -> the teacher's sparse top-k logprobs in the content-keyed cache.

`score(cfg)` runs one score task (`ScoreConfig`); `pipeline/score/run.py` is its command line (`gkd score`).

One sample's path: rollout row (prompt_ids + completion_ids) -> input_ids x_0..x_{L-1}, P = len(prompt_ids) ->
content key -> (skipped if cached) -> vLLM prompt_logprobs: entry j >= 1 is the teacher distribution of x_j given
x_<j (entry 0 is empty) -> positions j = P..L-1 stored as top-k ids/logprobs, the actual token's rank/logprob and the
tail -> a part shard `scored-<tag>-<task>-pNNNN.parquet` -> the task marker `tasks/<tag>-<task>.done`, written last.

Privileged-context teacher (OPSD): a rollout with `teacher_prompt_ids` T is scored on T + completion (the engine's
positions |T|..) and stored as the student sees it, input_ids = prompt + completion with first_scored = P, so the
trainer pairs stored row i (completion token i, given T and the completion before it) with the student's logits on
prompt + completion at the same completion token. Its content key covers T.

A rerun skips scored keys (so a killed task resumes where its last complete part ended) and a finished task is a
no-op. Rows go to tasks by a hash of their content key, so identical sequences always meet in the same task.

The stage, one idea a module (each imports only those above it; this one, the recipe, is at the top):

    config.py      ScoreConfig and its validation (a leaf)
    errors.py      ScoreInputError, TeacherOutputError
    numerics.py    the engine settings that change the stored logprobs (the cache's `numerics`)
    tokenizers.py  which tokenizer made the rollouts; a cross-tokenizer task's two tokenizers
    rows.py        which rows a task scores, what it refuses before any teacher work, the engine's token batches
    extract.py     the teacher's flat prompt logprobs -> the stored arrays, checked finite
    teacher.py     the in-process teacher: its folder, its vLLM engine, the score loop's engine around it
    served/        a served teacher (a vLLM OpenAI-compatible server): client, probe (identity), access, logprobs
    hidden.py      teacher_rows=hidden: the pooling engine's per-token hidden states -> stored rows
    writer.py      the writer threads (the engine scores while outputs are extracted and parts written)
    parts.py       extracted rows -> parts published into the cache
    scorer.py      `score` / `status`: a task opened, its rows selected, scored, written, its marker last
    run.py         the command line (`gkd score`)
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError
from pipeline.engine import engine_version
from pipeline.score.config import ScoreConfig
from pipeline.score.errors import ScoreInputError
from pipeline.score.hidden import ROUTE as HIDDEN_ROUTE
from pipeline.score.hidden import HiddenTeacher, hidden_teacher
from pipeline.score.numerics import check_engine_numerics, scoring_numerics
from pipeline.score.parts import Parts
from pipeline.score.rows import check_image_alignment, select_rows, token_batches
from pipeline.score.served.client import ServedTeacher
from pipeline.score.served.probe import reconcile_probe
from pipeline.score.teacher import check_expansion, engine_length, in_process_teacher, resolve_teacher
from pipeline.score.tokenizers import CrossTokenizer, check_rollout_tokenizer, cross_tokenizers, store_teacher_tokenizer
from pipeline.score.writer import BatchWriter
from pipeline.slurm.arrays import array_spec, shard_index
from pipeline.store import Descriptor, TeacherCache
from pipeline.store import hidden as hidden_store
from pipeline.store import images as image_store
from pipeline.store.cache import CROSS_COLUMNS, DESCRIPTOR
from pipeline.store.codec import params as codec_params
from pipeline.store.fingerprint import (
    FINGERPRINT_SCHEME,
    adapter_fingerprint,
    teacher_fingerprint,
    tokenizer_fingerprint,
)
from pipeline.store.model_config import vocab_size as model_vocab_size
from pipeline.store.rollouts import rollout_shards
from pipeline.store.schema import load_schema
from pipeline.store.shards import atomic_write_bytes, read_marker
from pipeline.store.tasks import (
    missing_score_tasks,
    rollouts_tag,
    task_done,
    task_lock,
    task_marker,
    task_name,
    write_result,
)


def status(cfg: ScoreConfig) -> int:
    """Print which of the num_shards tasks are not done, as a ready `--array=` list; exit 1 if any."""
    paths = rollout_shards(cfg.rollouts)
    tag = rollouts_tag(paths, cfg.tags, cfg.tag_key)
    root = Path(cfg.cache)
    missing = missing_score_tasks(root, tag, cfg.num_shards)
    if not missing:
        print(f"all {cfg.num_shards} score tasks of rollouts {cfg.rollouts} ({tag}) are done")
        return 0
    print(f"{len(missing)} of {cfg.num_shards} score tasks missing; resubmit with:\n--array={array_spec(missing)}")
    return 1


def score(cfg: ScoreConfig, llm=None) -> dict:
    """Run one score task; returns its summary. `llm` lets a caller (tests, the on-policy driver) reuse an engine.
    A second process of the same task (same rollouts, shard and num_shards) is refused while the first runs."""
    with contextlib.ExitStack() as locks:
        return _score(cfg, llm, locks)


@dataclass
class _Task:
    """What `_open_task` found before any rollout is read: the teacher (folder, engine length, or a server), the
    rollout shards, the cache it scores into."""

    teacher: Path
    paths: list[Path]
    cross: CrossTokenizer | None
    vocab_size: int
    image_token: int | None
    engine_len: int
    served: Any
    teacher_fp: str
    cache: TeacherCache
    t0: float  # when the task's work began (the summary's seconds)
    output_weight: Any = None  # teacher_rows=hidden: the teacher's output layer [V, H] (store/hidden.py)


def _open_task(cfg: ScoreConfig, llm) -> _Task:
    """The checks before any work, cheap ones first, then the teacher's fingerprint and the cache (created, or
    opened and compared with this run's descriptor)."""
    problems = cfg.validate()  # also for configs built in code (the on-policy driver's), not only loaded ones
    if problems:
        raise ConfigError("; ".join(problems))
    teacher = resolve_teacher(cfg.teacher)
    if cfg.hidden:  # before any work: a teacher whose logits are not hidden · Wᵀ, or an engine handed in
        hidden_store.check_teacher(teacher)
        if llm is not None and not isinstance(llm, HiddenTeacher):
            raise ConfigError("teacher_rows=hidden scores through a pooling engine (score/hidden.py), not the "
                              "generate engine passed to score(): pass llm=None or an open hidden_teacher, or score "
                              "with teacher_rows=topk")
    t0 = time.time()
    from transformers import AutoConfig, AutoTokenizer

    # Cheap checks first: the rollouts' tokenizer against the teacher's, before the weights are even hashed.
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tok_fp = tokenizer_fingerprint(tokenizer)
    paths = rollout_shards(cfg.rollouts)
    if not paths:
        raise ScoreInputError(f"{cfg.rollouts}: no complete rollout shards (*.parquet with a .ok marker)")
    cross = cross_tokenizers(cfg, tokenizer, tok_fp, teacher) if cfg.cross_tokenizer else None
    check_rollout_tokenizer(paths, tok_fp, teacher, None if cross is None else cross.student_fp)
    numerics = scoring_numerics(cfg)
    if llm is not None and not cfg.hidden:  # a pooling engine returns states, not the logprobs numerics govern
        check_engine_numerics(llm, numerics)
    if cfg.teacher_adapter:
        if llm is not None:
            raise ConfigError("teacher_adapter cannot score through an engine passed to score(): the stage merges the "
                              "adapter into a temporary teacher folder and opens its own engine on it (llm=None)")
        if not (Path(cfg.teacher_adapter) / "adapter_config.json").exists():
            raise ConfigError(f"teacher_adapter: {cfg.teacher_adapter} is not a peft LoRA folder (no adapter_config.json)")
    teacher_config = AutoConfig.from_pretrained(teacher)
    vocab_size = model_vocab_size(teacher_config)
    if cfg.stored_k > vocab_size:  # before cache.json is written (it would record the k) and before any engine starts
        raise ConfigError(f"topk={cfg.topk} is above the teacher's vocabulary ({teacher}/config.json: vocab_size="
                          f"{vocab_size}); choose --topk <= {vocab_size} (a top-k beyond it holds no more tokens)")
    image_token = image_store.image_token_id(json.loads((teacher / "config.json").read_text()))
    engine_len = engine_length(cfg, teacher_config)
    served = probe = scheme = None
    if cfg.teacher_url:
        if llm is not None:
            raise ConfigError("teacher_url: a served teacher scores through its server, not an engine passed to score()")
        served, teacher_fp, probe, teacher_name, engine_name = _served_teacher(cfg, teacher, tokenizer, vocab_size,
                                                                              engine_len, image_token)
    else:
        scheme = cache_fingerprint_scheme(cfg.cache)
        teacher_fp = teacher_fingerprint(teacher, scheme)  # from the fingerprint record when the files are unchanged
        if cfg.teacher_adapter:
            teacher_fp = adapter_fingerprint(teacher_fp, cfg.teacher_adapter)  # base weights + adapter config/weights

        teacher_name = str(teacher) + (f" + adapter {cfg.teacher_adapter}" if cfg.teacher_adapter else "")
        engine_name = engine_version()

    weight = layer = hidden = None
    if cfg.hidden:  # the output layer, stored once in the cache; its sha256 is part of the cache's identity
        weight = hidden_store.output_layer(teacher)
        layer = hidden_store.output_layer_bytes(weight)
        hidden = {"dtype": cfg.hidden_dtype, "size": str(weight.shape[1]), "output_layer": hidden_store.OUTPUT_LAYER,
                  "output_layer_sha256": hidden_store.sha256(layer), "route": HIDDEN_ROUTE}
    descriptor = Descriptor(
        teacher_fingerprint=teacher_fp,
        tokenizer_fingerprint=tok_fp,
        k=cfg.stored_k,
        logprob_mode=cfg.logprob_mode,
        teacher=teacher_name,
        vocab_size=vocab_size,
        engine=engine_name,
        numerics=numerics,
        codec=codec_params(cfg.codec, cfg.topp),
        topp=None if cfg.topp is None else float(cfg.topp),
        min_k=cfg.resolved_min_k,
        teacher_probe=probe,
        fingerprint_scheme=scheme,
        **({} if cross is None else {"student_tokenizer_fingerprint": cross.student_fp,
                                     "schema_version": load_schema("scored").written(CROSS_COLUMNS).version}),
        **({} if hidden is None else {"teacher_rows": hidden_store.KIND, "hidden": hidden, "schema_version":
                                      load_schema("scored").written({hidden_store.COLUMN}).version}),
    )
    cache = TeacherCache.create_or_open(cfg.cache, descriptor)  # refuses another teacher/tokenizer/k/numerics first
    if cross is not None:
        store_teacher_tokenizer(cache.root, tokenizer)
    if layer is not None and not (cache.root / hidden_store.OUTPUT_LAYER).is_file():
        atomic_write_bytes(cache.root / hidden_store.OUTPUT_LAYER, layer)  # its bytes are cache.json's sha256
    return _Task(teacher, paths, cross, vocab_size, image_token, engine_len, served, teacher_fp, cache, t0, weight)


def _served_teacher(cfg: ScoreConfig, teacher: Path, tokenizer, vocab_size: int, engine_len: int,
                    image_token: int | None = None):
    """The served teacher's engine and identity (score/served/), checked against the server and against an
    existing cache before the cache is touched: (engine, fingerprint, probe, descriptor teacher, engine name). A
    vision-language teacher sends rollouts' images with their ids, its expansion checked as in process."""
    served = ServedTeacher(cfg.teacher_url, cfg.teacher_model, cfg.topk, inflight_tokens=cfg.served_inflight_tokens,
                           concurrency=cfg.served_concurrency, retries=cfg.served_retries,
                           timeout_s=cfg.served_timeout_s, api_key_env=cfg.teacher_api_key_env,
                           image_token=image_token, image_root=Path(cfg.rollouts), check_expansion=check_expansion)
    info = served.describe(vocab_size, tokenizer)
    served_len = info["max_model_len"]
    if served_len is not None and int(served_len) < engine_len:
        raise ConfigError(
            f"teacher_url: {cfg.teacher_url} serves {served.model!r} with max_model_len {served_len}, but scoring "
            f"sequences of up to max_model_len={engine_len - 1} tokens needs {engine_len} (one sampled token after "
            f"them): restart the server with --max-model-len {engine_len}, or score with max_model_len={int(served_len) - 1}")
    fingerprint = reconcile_probe(cfg.cache, info["fingerprint"], info["probe"])
    return (served, fingerprint, info["probe"], f"served {served.model} at {cfg.teacher_url} (tokenizer {teacher})",
            f"vllm {info['version']} (OpenAI server)")


def cache_fingerprint_scheme(cache: str | Path) -> int:
    """How the teacher fingerprint of the cache at `cache` was computed (a new cache: the current scheme), so a run
    adding rows to an old cache computes the fingerprint its keys were made with."""
    path = Path(cache) / DESCRIPTOR
    if not path.is_file():
        return FINGERPRINT_SCHEME
    return Descriptor.read(path).teacher_fingerprint_scheme


def _score(cfg: ScoreConfig, llm, locks: contextlib.ExitStack) -> dict:
    shard = shard_index(cfg.shard, cfg.num_shards)  # the entry (score/run.py) resolved $SLURM_ARRAY_TASK_ID
    task = _open_task(cfg, llm)
    cache, cross = task.cache, task.cross
    tag = rollouts_tag(task.paths, cfg.tags, cfg.tag_key)
    name = task_name(tag, shard, cfg.num_shards)
    locks.enter_context(task_lock(cache.root, name))  # also shows a read-only cache before any teacher work
    if task_done(cache.root, name):
        print(f"[score] task {shard}/{cfg.num_shards} of rollouts {tag} is already done: nothing to do")
        return {"done_before": True, "teacher_forwards": 0}

    counts: dict[str, int] = {}
    rows = select_rows(cfg, task.paths, task.teacher_fp, shard, task.vocab_size, task.engine_len - 1, counts,
                       task.image_token, cross)
    if cross is not None and cross.mismatched:  # reported per sample (on_mismatch=skip; error raised above)
        print(f"[score] {len(cross.mismatched)} rollout(s) skipped, their text does not round-trip: "
              + "; ".join(cross.mismatched[:10]) + (" ..." if len(cross.mismatched) > 10 else ""), file=sys.stderr)
    have = cache.keys()
    todo = [r for r in rows if r["key"] not in have]
    pictured = [r for r in todo if r.get("images")]
    if pictured:  # a served teacher's server expands them too: checked again per row against its answer
        check_image_alignment(pictured, task.teacher, task.image_token, Path(cfg.rollouts))
    counts["cached"] = len(rows) - len(todo)
    prior_parts = sorted(p.name[: -len(".parquet")] for p in cache.shard_dir.glob(f"{name}-p*.parquet") if read_marker(p))

    summary = {"task": name, "rows": len(rows), "scored": 0, "tokens": 0, "teacher_forwards": 0, "skipped": counts}
    if cross is not None:
        summary["mismatched"] = cross.mismatched
    parts = list(prior_parts)
    if todo:
        _score_rows(cfg, llm, task, todo, name, parts, counts, shard, summary)
        summary["scored"] = len(todo)
    _finish_task(cfg, cache, name, shard, summary, counts, parts, prior_parts, task.t0, rows, todo)
    return summary


def _score_rows(cfg: ScoreConfig, llm, task: _Task, todo: list[dict], name: str, parts: list[str], counts: dict,
                shard: int, summary: dict) -> None:
    """Score `todo` through the task's engine (or server); the writer thread publishes its parts as it goes."""
    from tqdm import tqdm

    stack = contextlib.ExitStack()
    if task.served is not None:
        engine = task.served
    elif cfg.hidden:
        engine = llm if llm is not None else stack.enter_context(hidden_teacher(cfg, task.teacher, task.engine_len))
    else:
        engine = stack.enter_context(in_process_teacher(
            cfg, task.teacher, llm, task.engine_len, image_token=task.image_token,
            max_images=max((len(r.get("images") or ()) for r in todo), default=0)))
    total_tokens = sum(len(r["engine_ids"]) for r in todo)
    out = Parts(task.cache, name, parts, counts, cfg, task.teacher if task.served is None else cfg.teacher_url,
                task.output_weight)
    writer = BatchWriter(out.add, cfg.write_queue)
    with stack:
        bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc=f"score {shard}/{cfg.num_shards}", file=sys.stderr)
        t_score = time.time()
        with out.part_writer.running():  # part i is encoded and committed while the batches of part i + 1 are extracted
            with writer.running():  # batch i is extracted while the engine scores batch i + 1
                for batch, flats in engine.score_batches(token_batches(todo, cfg.batch_tokens)):
                    summary["teacher_forwards"] += len(batch)
                    summary["tokens"] += sum(len(r["input_ids"]) - r["first_scored"] for r in batch)
                    writer.put((batch, flats))
                    bar.update(sum(len(r["engine_ids"]) for r in batch))
            out.flush()  # the last, partial part: only when every batch was scored and handled
        bar.close()
        summary["score_seconds"] = time.time() - t_score


def _finish_task(cfg: ScoreConfig, cache: TeacherCache, name: str, shard: int, summary: dict, counts: dict,
                 parts: list[str], prior_parts: list[str], t0: float, rows: list[dict], todo: list[dict]) -> None:
    """The task's marker (its summary, written last: the task is done) and its one line of report."""
    new_parts = [p for p in parts if p not in prior_parts]
    nbytes = sum((cache.shard_dir / f"{p}.parquet").stat().st_size for p in new_parts)
    summary.update(
        parts=parts,
        seconds=time.time() - t0,
        bytes_per_token=round(nbytes / summary["tokens"], 1) if summary["tokens"] else None,
    )
    write_result(task_marker(cache.root, name), summary)
    tok_s = summary["tokens"] / summary["score_seconds"] if summary.get("score_seconds") else 0.0
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"
    print(
        f"[score] task {shard}/{cfg.num_shards}: scored {summary['scored']} samples ({summary['tokens']} tokens, "
        f"{tok_s:.0f} tok/s, {summary['bytes_per_token'] or '-'} B/token), skipped {skipped}, "
        f"teacher forwards {summary['teacher_forwards']}"
        + ("" if todo else " — no rows assigned to this task" if not rows else " — everything was already cached")
    )
