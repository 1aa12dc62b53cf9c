"""A tiny random Llama with a real fast tokenizer, and a teacher cache scored from a model by a plain transformers
forward (log_softmax -> top-k), standing in for the score stage. Shared by tests/train (conftest fixtures) and the
Slurm trainer test (imported by name: tests/conftest.py puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pipeline.store import Descriptor, TeacherCache
from pipeline.store.fingerprint import content_key, sample_id, teacher_fingerprint, tokenizer_fingerprint

K = 8


def build_tiny(out: Path, seed: int = 0) -> Path:
    from tiny_models import build_llama, build_tokenizer

    tok = build_tokenizer(out)
    return build_llama(out, vocab_size=len(tok), layers=2, hidden=64, heads=2, kv_heads=2, seed=seed, scale=25.0)  # sharp, context-dependent distributions


def score_into_cache(model_dir: Path, cache_dir: Path, samples: list[tuple[np.ndarray, int, str]], *, k: int = K,
                     shard_rows: int = 8, codec: str = "rank-grid-esc", topp: float | None = None,
                     min_k: int | None = None, tags: list[dict] | None = None,
                     versions: list[int] | None = None, behavior: list | None = None) -> TeacherCache:
    """Score (input_ids, first_scored, source) samples with an HF forward; row r = teacher of token P + r.
    `topp`/`min_k`: a variable-k cache with cap k (the codec truncates each position, as in `gkd score`).
    `tags`: the rollout tags of each sample (what the trainer routes on), stored with its row. `versions`: each
    student sample's policy_version (default 0). `behavior`: each sample's completion_logprobs (the sampler's
    logprob of each token after P; None: the row has none)."""
    from transformers import AutoModelForCausalLM

    from pipeline.store.codec import params as codec_params

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    desc = Descriptor(
        teacher_fingerprint=teacher_fingerprint(model_dir), tokenizer_fingerprint=tokenizer_fingerprint(model_dir),
        k=k, logprob_mode="raw_logprobs", vocab_size=model.config.vocab_size, codec=codec_params(codec, topp),
        topp=topp, min_k=min_k,
    )
    cache = TeacherCache.create_or_open(cache_dir, desc)
    rows = []
    for i, (ids, p, source) in enumerate(samples):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].float(), -1)
        dist = lp[p - 1 : len(ids) - 1]  # logits at t predict token t + 1
        top = dist.topk(k, dim=-1)
        actual = torch.as_tensor(ids[p:], dtype=torch.long)
        actual_lp = dist.gather(1, actual[:, None])[:, 0]
        rows.append({
            "key": content_key(desc.teacher_fingerprint, ids, p, k, desc.logprob_mode),
            "sample_id": sample_id("p", ids[:p], ids[p:]),
            "source": source,
            "policy_version": None if source == "dataset" else (versions[i] if versions else 0),
            "input_ids": ids,
            "first_scored": p,
            "topk_ids": top.indices.numpy().astype(np.int32),
            "topk_logprobs": top.values.numpy().astype(np.float32),
            "actual_ranks": ((dist > actual_lp[:, None]).sum(1) + 1).numpy().astype(np.int32),
            "actual_logprobs": actual_lp.numpy().astype(np.float32),
            "tags": None if tags is None else tags[i],
            "completion_logprobs": None if behavior is None else behavior[i],
        })
    for i in range(0, len(rows), shard_rows):
        cache.write_shard(f"scored-{i // shard_rows:05d}", rows[i : i + shard_rows])
    return cache


def random_samples(n: int, vocab: int, seed: int = 0, lengths=(12, 40)) -> list[tuple[np.ndarray, int, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(*lengths))
        p = int(rng.integers(1, length // 2))
        out.append((rng.integers(3, vocab, size=length).astype(np.int32), p, "dataset" if i % 2 else "student"))
    return out


def train_tiny(student: Path, cache: Path, save: Path, steps: int) -> list[dict]:
    """`gkd train` (in-process CLI) of a tiny student on one cache, micro-batches of 2 x 64; its metrics.jsonl rows."""
    import json

    from pipeline.cli import main as cli

    args = dict(student=str(student), cache=f"[{cache}]", micro_batch_size=2, global_batch_size=2, seq_length=64,
                train_steps=steps, warmup_steps=1, save_interval=steps, save_dir=str(save), progress=False)
    assert cli(["train", *[f"{k}={v}" for k, v in args.items()]]) == 0
    return [json.loads(line) for line in (Path(save) / "metrics.jsonl").read_text().splitlines()]


XTOK_PROMPTS = ["What is three times four?", "Say something about the fox.", "Seven plus five?",
                "Explain distillation.", "Count to twenty.", "Tell me about caches.", "What does the teacher do?",
                "Name some numbers."]
XTOK_ANSWERS = ["The answer is twelve.", "The quick brown fox jumps over the lazy dog.", "Seven plus five is twelve.",
                "Knowledge distillation trains a small model to match a large one: 3 × 4 = 12.",
                "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
                "A teacher scores the rollouts once; many students learn from the cache.",
                "It scores the rollouts once, and the students learn from the cache.",
                "Questions and answers, prompts and completions, tokens and logits."]


def xtok_rollouts(student_tok, n: int = len(XTOK_PROMPTS), source: str = "dataset") -> list[dict]:
    """Chat rollouts in the student's tokens (its template applied once, as gkd import does)."""
    from pipeline.store.rollouts import rollout_row

    rows = []
    for i in range(n):
        q, a = XTOK_PROMPTS[i % len(XTOK_PROMPTS)], XTOK_ANSWERS[i % len(XTOK_ANSWERS)]
        text = student_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False)
        rows.append(rollout_row(prompt_id=f"x{i}", prompt_ids=student_tok(text, add_special_tokens=False).input_ids,
                                completion_ids=student_tok(a + "<|im_end|>", add_special_tokens=False).input_ids,
                                source=source))
    return rows


def score_cross_into_cache(teacher_dir: Path, student_dir: Path, cache_dir: Path, rollouts: list[dict], *,
                           k: int = K, codec: str = "exact-f32") -> TeacherCache:
    """What `gkd score cross_tokenizer=true` stores (its own row builder, score/rows.py cross_row), with the
    teacher's rows from a plain transformers forward on the teacher's tokens instead of vLLM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.score.rows import cross_row
    from pipeline.score.tokenizers import CrossTokenizer, store_teacher_tokenizer
    from pipeline.store.codec import params as codec_params
    from pipeline.store.schema import load_schema

    student, teacher = AutoTokenizer.from_pretrained(student_dir), AutoTokenizer.from_pretrained(teacher_dir)
    cross = CrossTokenizer(student, teacher, tokenizer_fingerprint(student), tokenizer_fingerprint(teacher))
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    desc = Descriptor(teacher_fingerprint=teacher_fingerprint(teacher_dir), tokenizer_fingerprint=cross.teacher_fp,
                      k=k, logprob_mode="raw_logprobs", vocab_size=model.config.vocab_size, codec=codec_params(codec),
                      student_tokenizer_fingerprint=cross.student_fp, schema_version=load_schema("scored").version)
    cache = TeacherCache.create_or_open(cache_dir, desc)
    store_teacher_tokenizer(cache.root, teacher)
    rows = []
    for r in rollouts:
        extra = cross_row(r, cross)
        assert not isinstance(extra, str), extra
        ids, p = extra["input_ids"], extra["first_scored"]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].float(), -1)
        dist = lp[p - 1: len(ids) - 1]
        top = dist.topk(k, dim=-1)
        actual = torch.as_tensor(ids[p:], dtype=torch.long)
        actual_lp = dist.gather(1, actual[:, None])[:, 0]
        student_ids = r["prompt_ids"] + r["completion_ids"]
        rows.append({**r, **extra,
                     "key": content_key(desc.teacher_fingerprint, student_ids, len(r["prompt_ids"]), k,
                                        desc.logprob_mode, cross=cross.key),
                     "topk_ids": top.indices.numpy().astype(np.int32),
                     "topk_logprobs": top.values.numpy().astype(np.float32),
                     "actual_ranks": ((dist > actual_lp[:, None]).sum(1) + 1).numpy().astype(np.int32),
                     "actual_logprobs": actual_lp.numpy().astype(np.float32)})
    cache.write_shard("scored-xtok-00000", rows)
    return cache


def hidden_cache_from_hf(model_dir: Path, cache_dir: Path, samples: list[tuple[np.ndarray, int, str]]) -> TeacherCache:
    """A hidden-state cache (store/hidden.py) of (input_ids, first_scored, source) samples from an HF forward (no
    engine: for the refusals, which read only its descriptor; `gkd score teacher_rows=hidden` is tested with vLLM)."""
    from transformers import AutoModelForCausalLM

    from pipeline.store import hidden as hidden_store
    from pipeline.store.schema import load_schema
    from pipeline.store.shards import atomic_write_bytes

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weight = hidden_store.output_layer(model_dir)
    layer = hidden_store.output_layer_bytes(weight)
    mode = hidden_store.key_mode("raw_logprobs", "bfloat16")
    desc = Descriptor(
        teacher_fingerprint=teacher_fingerprint(model_dir), tokenizer_fingerprint=tokenizer_fingerprint(model_dir),
        k=0, logprob_mode="raw_logprobs", vocab_size=model.config.vocab_size, teacher_rows=hidden_store.KIND,
        hidden={"dtype": "bfloat16", "size": str(weight.shape[1]), "output_layer": hidden_store.OUTPUT_LAYER,
                "output_layer_sha256": hidden_store.sha256(layer), "route": "transformers forward (tests)"},
        schema_version=load_schema("scored").written({hidden_store.COLUMN}).version,
    )
    cache = TeacherCache.create_or_open(cache_dir, desc)
    atomic_write_bytes(cache.root / hidden_store.OUTPUT_LAYER, layer)
    rows = []
    for ids, p, source in samples:
        with torch.no_grad():
            out = model(torch.as_tensor(ids[None], dtype=torch.long), output_hidden_states=True)
        h = out.hidden_states[-1][0, p - 1: len(ids) - 1]
        lp = torch.log_softmax(out.logits[0, p - 1: len(ids) - 1], -1)
        actual = lp.gather(1, torch.as_tensor(ids[p:], dtype=torch.long)[:, None])[:, 0]
        n = len(ids) - p
        rows.append({"key": content_key(desc.teacher_fingerprint, ids, p, 0, mode),
                     "sample_id": sample_id("p", ids[:p], ids[p:]), "source": source,
                     "policy_version": None if source == "dataset" else 0, "input_ids": ids, "first_scored": p,
                     "topk_ids": np.zeros((n, 0), np.int32), "topk_logprobs": np.zeros((n, 0), np.float32),
                     "actual_ranks": ((lp > actual[:, None]).sum(1) + 1).numpy().astype(np.int32),
                     "actual_logprobs": actual.numpy().astype(np.float32), "hidden_states": h})
    cache.write_shard("scored-00000", rows)
    return cache
