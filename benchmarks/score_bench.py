"""Score-stage and cache benchmarks on the real embedded-default teacher (SmolLM2-135M-Instruct, vLLM, fp32).

    python -m benchmarks.run --only score          # part of `make bench`

In one process and one vLLM engine, on the same token batches:
- throughput: a bare vLLM call (flat logprobs, no detokenisation, result discarded) vs our whole score path
  (extraction + encoding + atomic Parquet writes) vs the dict-form + detokenise path a server-based teacher uses;
  rounds interleaved so the shared machine's noise hits all alike;
- cache size per scored token for English prose and templated math, with baselines encoded from the same rows;
- codec fidelity (max abs error, KL over the k+1 bins) and decode speed into the trainer's arrays;
- top-p (variable k) caches at P = 0.99 and 0.995 (cap 64, min_k 1) through the same score path: bytes per token
  and the mean kept k;
- our codec against Megatron-LM's logits-saver layout (fp16 values + 16-bit ids + a 17th-bit flag plane, zstd-3)
  on the same unquantised prose rows, at ~1k positions (small shards: per-cycle on-policy views, small parts) and
  at all of them.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.assets import teacher_dir
from pipeline.engine import EngineArgs, open_engine
from pipeline.score.config import ScoreConfig
from pipeline.score.extract import extract
from pipeline.score.rows import token_batches
from pipeline.score.scorer import score
from pipeline.store import Descriptor, TeacherCache, codec
from pipeline.store.fingerprint import content_key, tokenizer_fingerprint
from pipeline.store.rollouts import iter_rollouts, rollout_row, rollout_shards, write_rollouts

K = 64
BENCH_KEY_ENV = "GKD_BENCH_TEACHER_KEY"
FORTUNES = Path("/usr/share/games/fortunes")


def prose_text() -> tuple[str, str]:
    """Diverse English prose: Debian's fortunes-min (fortunes, literature, riddles) if installed, else the
    docstrings of the Python standard library."""
    files = [FORTUNES / n for n in ("fortunes", "literature", "riddles") if (FORTUNES / n).exists()]
    if files:
        return "\n".join(f.read_text(errors="replace") for f in files), "Debian fortunes-min (fortunes, literature, riddles)"
    import pydoc
    import sys

    parts = []
    for name in sorted(sys.stdlib_module_names - {"this", "antigravity"}):  # importing these prints / opens a browser
        try:
            mod = __import__(name)
        except Exception:  # noqa: BLE001 - some stdlib modules do not import on every platform
            continue
        if mod.__doc__:
            parts.append(pydoc.getdoc(mod))
    return "\n\n".join(parts), "Python standard library docstrings"


def prose_rows(tokenizer, tokens: int, *, prompt: int = 1, chunk: int = 256) -> tuple[list[dict], str]:
    """The benches' prose rollouts: the first `tokens` tokens of `prose_text` cut into samples of `chunk` tokens,
    the first `prompt` of each its prompt; with the text's source."""
    text, source = prose_text()
    ids = tokenizer(text)["input_ids"][:tokens]
    return [rollout_row(prompt_id=f"prose-{i}", prompt_ids=ids[i : i + prompt], completion_ids=ids[i + prompt : i + chunk],
                        source="dataset") for i in range(0, len(ids) - 16, chunk)], source


def build_rollouts(out: Path, tokenizer, prose_tokens: int, math_samples: int) -> dict[str, Path]:
    prose, source = prose_rows(tokenizer, prose_tokens)
    import reasoning_gym

    math = []
    for task in ("basic_arithmetic", "gsm_symbolic"):
        for i, e in enumerate(reasoning_gym.create_dataset(task, size=math_samples // 2, seed=1)):
            msgs = [{"role": "user", "content": e["question"]}]
            text = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": str(e["answer"])}], tokenize=False)
            full = tokenizer(text, add_special_tokens=False)["input_ids"]
            # score every position after the first (prompt and answer): the templated text is what repeats
            math.append(rollout_row(prompt_id=f"{task}-{i}", prompt_ids=full[:1], completion_ids=full[1:], source="dataset"))
    dirs = {"prose": out / "prose", "math": out / "math"}
    fp = tokenizer_fingerprint(tokenizer)
    write_rollouts(dirs["prose"] / "r-00000-of-00001.parquet", prose, tokenizer_fingerprint=fp)
    write_rollouts(dirs["math"] / "r-00000-of-00001.parquet", math, tokenizer_fingerprint=fp)
    return {**dirs, "prose_source": source}


def _baselines(raw: list[dict], vocab: int) -> dict[str, float]:
    """Bytes per scored token of simple encodings of the same rows (all Parquet-framed where stated)."""
    ids = np.concatenate([r["topk_ids"] for r in raw]).astype(np.int32)
    lps = np.concatenate([r["topk_logprobs"] for r in raw]).astype(np.float32)
    n = ids.shape[0]
    out = {"raw int32 ids + fp32 logprobs": (ids.nbytes + lps.nbytes) / n}
    offsets = np.concatenate([[0], np.cumsum([len(r["topk_ids"]) for r in raw])]) * K
    table = pa.table({
        "ids": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids.ravel())),
        "lps": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(lps.ravel().astype(np.float16))),
    })
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", compression_level=9)
    out["Parquet int32 ids + fp16 logprobs, zstd"] = buf.tell() / n
    bits = int(np.ceil(np.log2(vocab)))
    # DistillKit-style: ids bit-packed at ceil(log2 V) bits, exact (fp32) top values, no entropy coding
    out[f"bit-packed ids ({bits} bits) + exact fp32 values"] = (bits * K / 8 + 4 * K)
    return out


TOPP = (0.99, 0.995)


def topp_stats(cache_dir: Path) -> dict[str, float]:
    """A top-p cache's size and the entries it keeps per position (mean, median, share at the cap k)."""
    cache = TeacherCache.open(cache_dir)
    st = cache.stats()
    counts = np.concatenate([b.topk.counts for b in cache.iter_batches(batch_rows=256)])
    return {"scored_tokens": st["scored_tokens"], "bytes_per_token": st["bytes"] / st["scored_tokens"],
            "mean_k": float(counts.mean()), "median_k": float(np.median(counts)),
            "share_at_cap": float((counts == cache.descriptor.k).mean())}


def megatron_layout_bytes(ids: np.ndarray, lps: np.ndarray) -> int:
    """Megatron-LM's logits-saver layout of top-k rows ([n, k] ids and logprobs): fp16 values, the low 16 bits of
    each id, and one bit plane for the 17th id bit (vocabularies past 65,536), concatenated and compressed with
    zstd level 3."""
    import zstandard

    ids = np.asarray(ids, dtype=np.int64)
    blob = (np.asarray(lps, dtype=np.float16).tobytes() + (ids & 0xFFFF).astype("<u2").tobytes()
            + np.packbits(((ids >> 16) & 1).astype(np.uint8)).tobytes())
    return len(zstandard.ZstdCompressor(level=3).compress(blob))


def _megatron_comparison(raw: list[dict], work: Path, vocab: int) -> dict[str, dict]:
    """Same rows, fixed k=64: our whole shard file (every column, footer included) written by the cache vs the
    Megatron-LM layout of the top-k alone, at the first ~1k positions and at all of them."""
    out = {}
    first_1k = int(np.searchsorted(np.cumsum([len(r["topk_ids"]) for r in raw]), 1000)) + 1
    for label, rows in (("1k", raw[:first_1k]), ("all", raw)):
        desc = Descriptor(teacher_fingerprint="bench", tokenizer_fingerprint="bench", k=K,
                          logprob_mode="raw_logprobs", vocab_size=vocab)
        cache = TeacherCache.create_or_open(work / label, desc)
        cache.write_shard("part", [{
            "key": content_key("bench", r["input_ids"], r["first_scored"], K, "raw_logprobs"), "sample_id": f"s{i}",
            "source": "dataset", "policy_version": None, **r} for i, r in enumerate(rows)])
        n = sum(len(r["topk_ids"]) for r in rows)
        ours = (work / label / "shards" / "part.parquet").stat().st_size
        theirs = megatron_layout_bytes(np.concatenate([r["topk_ids"] for r in rows]),
                                       np.concatenate([r["topk_logprobs"] for r in rows]))
        out[label] = {"positions": n, "ours_bytes_per_token": ours / n, "megatron_bytes_per_token": theirs / n,
                      "ratio": ours / theirs, "rows": len(rows)}
    return out


def _fidelity(raw: list[dict]) -> dict[str, float]:
    rows = [(r["topk_ids"], r["topk_logprobs"], r["actual_ids"], r["actual_ranks"], r["actual_logprobs"]) for r in raw]
    enc = codec.encode(rows, k=K, vocab_size=1 << 16)
    table = pa.table({c: pa.array(getattr(enc, c), pa.binary()) for c in ("topk_ids", "topk_logprobs", "tail_logprobs", "actual_rank", "actual_logprobs")})
    dec = codec.Decoder(enc.footer).decode(table.to_batches(max_chunksize=1 << 30)[0], np.array([len(r[0]) for r in rows]))
    lps = np.concatenate([r[1] for r in rows]).astype(np.float64)
    assert (dec.topk_ids == np.concatenate([r[0] for r in rows])).all()
    p = np.exp(np.concatenate([lps, codec.tail_logprob(lps)[:, None]], 1))
    q = np.exp(np.concatenate([dec.topk_logprobs, dec.tail_logprobs[:, None]], 1).astype(np.float64))
    q /= q.sum(1, keepdims=True)
    with np.errstate(all="ignore"):
        kl = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0).sum(1)
    return {"max_abs_error_nat": float(np.abs(dec.topk_logprobs - lps).max()), "mean_kl": float(kl.mean())}


def run(work: Path | None = None, prose_tokens: int = 12_000, math_samples: int = 60, rounds: int = 2) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    teacher = teacher_dir()
    tok = AutoTokenizer.from_pretrained(teacher)
    work = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix="gkd-bench-"))
    dirs = build_rollouts(work / "rollouts", tok, prose_tokens, math_samples)
    res: dict = {"prose_source": dirs["prose_source"], "teacher": "SmolLM2-135M-Instruct (fp32, vLLM CPU)", "k": K}
    budget = 4096
    args = EngineArgs(model=str(teacher), dtype="float32", max_model_len=2049, kv_cache_gib=1.0, max_num_batched_tokens=budget)
    with open_engine(args, max_logprobs=K, logprobs_mode="raw_logprobs") as llm:
        # --- throughput, prose rollouts, same batches for every variant ---
        rows = [{"input_ids": np.asarray(r["prompt_ids"] + r["completion_ids"], np.int64), "first_scored": len(r["prompt_ids"])}
                for r in iter_rollouts(rollout_shards(dirs["prose"]))]
        batches = token_batches(rows, budget)
        tokens = sum(len(r["input_ids"]) for r in rows)
        flat = SamplingParams(max_tokens=1, prompt_logprobs=K, detokenize=False, flat_logprobs=True)
        dict_form = SamplingParams(max_tokens=1, prompt_logprobs=K, detokenize=True, flat_logprobs=False)
        llm.generate([TokensPrompt(prompt_token_ids=batches[0][0]["input_ids"].tolist())], flat, use_tqdm=False)  # warm-up
        times: dict[str, list[float]] = {"bare": [], "ours": []}
        raw: list[dict] = []
        for rnd in range(rounds):
            t = time.perf_counter()
            for b in batches:
                llm.generate([TokensPrompt(prompt_token_ids=r["input_ids"].tolist()) for r in b], flat, use_tqdm=False)
            times["bare"].append(time.perf_counter() - t)

            cfg = ScoreConfig(rollouts=str(dirs["prose"]), cache=str(work / f"cache-prose-{rnd}"), teacher=str(teacher), topk=K,
                              max_model_len=2048, batch_tokens=budget, part_rows=100_000)
            t = time.perf_counter()
            score(cfg, llm=llm)
            times["ours"].append(time.perf_counter() - t)

        # The dict + detokenise path is several times slower: time it once, on the first half of the batches.
        half = batches[: max(1, len(batches) // 2)]
        t = time.perf_counter()
        for b in half:
            outs = llm.generate([TokensPrompt(prompt_token_ids=r["input_ids"].tolist()) for r in b], dict_form, use_tqdm=False)
            for r, o in zip(b, outs, strict=True):  # what a server client does: dicts -> arrays
                pl = o.prompt_logprobs[r["first_scored"]:]
                [[(tid, lp.logprob, lp.decoded_token) for tid, lp in d.items()] for d in pl]
        dict_seconds = time.perf_counter() - t
        dict_tokens = sum(len(r["input_ids"]) for b in half for r in b)
        for b in batches:  # raw (unquantised) rows for fidelity and baselines, untimed
            outs = llm.generate([TokensPrompt(prompt_token_ids=r["input_ids"].tolist()) for r in b], flat, use_tqdm=False)
            for r, o in zip(b, outs, strict=True):
                raw.append({**extract(o.prompt_logprobs, r["input_ids"], r["first_scored"], K), **r,
                            "actual_ids": r["input_ids"][r["first_scored"]:]})
        med = {k: statistics.median(v) for k, v in times.items()}
        res["throughput"] = {
            "tokens": tokens,
            "bare_vllm_tok_s": tokens / med["bare"],
            "ours_tok_s": tokens / med["ours"],
            "dict_detok_tok_s": dict_tokens / dict_seconds,
            "ours_vs_bare": med["bare"] / med["ours"],
            "ours_vs_dict": (tokens / med["ours"]) / (dict_tokens / dict_seconds),
            "rounds": rounds,
        }
        # --- size: both corpora through the real score path (prose: the last timed round's cache) ---
        res["size"] = {}
        score(ScoreConfig(rollouts=str(dirs["math"]), cache=str(work / "cache-math"), teacher=str(teacher), topk=K,
                          max_model_len=2048, batch_tokens=budget, part_rows=100_000), llm=llm)
        for name, cache_dir in (("prose", work / f"cache-prose-{rounds - 1}"), ("math", work / "cache-math")):
            st = TeacherCache.open(cache_dir).stats()
            res["size"][name] = {"scored_tokens": st["scored_tokens"], "bytes_per_token": st["bytes"] / st["scored_tokens"]}
        # --- top-p caches: the same rollouts through the same score path, variable k ---
        res["topp"] = {}
        for topp in TOPP:
            for name in ("prose", "math"):
                cache_dir = work / f"cache-{name}-topp{topp}"
                score(ScoreConfig(rollouts=str(dirs[name]), cache=str(cache_dir), teacher=str(teacher), topk=K,
                                  topp=topp, min_k=1, max_model_len=2048, batch_tokens=budget, part_rows=100_000),
                      llm=llm)
                res["topp"][f"{name}@{topp}"] = topp_stats(cache_dir)
    res["baselines_prose"] = _baselines(raw, tok.vocab_size if hasattr(tok, "vocab_size") else len(tok))
    res["megatron_layout"] = _megatron_comparison(raw, work / "megatron", len(tok))
    res["fidelity_prose"] = _fidelity(raw)
    # --- decode speed: warm, single thread, prose cache into the trainer's arrays ---
    cache = TeacherCache.open(work / f"cache-prose-{rounds - 1}")
    list(cache.iter_batches(batch_rows=256))
    os.environ["OMP_NUM_THREADS"] = "1"
    t = time.perf_counter()
    n = 0
    for _ in range(5):
        for b in cache.iter_batches(batch_rows=256):
            n += int(b.topk.offsets[-1])
    res["decode_tok_s"] = n / (time.perf_counter() - t)
    res["prose_cache"] = str(work / f"cache-prose-{rounds - 1}")
    return res


def markdown(res: dict) -> str:
    t, s = res["throughput"], res["size"]
    lines = [
        f"Teacher: {res['teacher']}, k={res['k']}. Prose: {res['prose_source']}.",
        "",
        "| score path (same engine, same batches) | tokens/s | ratio |",
        "|---|---|---|",
        f"| bare vLLM call, flat logprobs, no detokenise, writes nothing | {t['bare_vllm_tok_s']:.0f} | 1.00 |",
        f"| **`gkd score`: + extraction, encoding, atomic Parquet writes** | {t['ours_tok_s']:.0f} | **{t['ours_vs_bare']:.2f}× bare** (goal ≥ 0.9) |",
        f"| dict form + detokenise (server-style client) | {t['dict_detok_tok_s']:.0f} | ours is **{t['ours_vs_dict']:.2f}×** faster (goal ≥ 5) |",
        "",
        f"({t['tokens']} tokens of prose per round, median of {t['rounds']} interleaved rounds; the dict path once, "
        "on half the batches.)",
        "",
        "| cache size on disk, all Parquet overhead included | scored tokens | bytes / scored token | goal |",
        "|---|---|---|---|",
        f"| prose | {s['prose']['scored_tokens']} | **{s['prose']['bytes_per_token']:.1f}** | ≤ 80 |",
        f"| templated math (reasoning-gym, chat template) | {s['math']['scored_tokens']} | **{s['math']['bytes_per_token']:.1f}** | ≤ 50 |",
        "",
        "| baseline on the same prose rows | bytes / scored token |",
        "|---|---|",
        *[f"| {name} | {v:.1f} |" for name, v in res["baselines_prose"].items()],
        "",
        f"Fidelity (prose): max abs logprob error {res['fidelity_prose']['max_abs_error_nat']:.5f} nat (bound 1/64 = 0.015625); "
        f"mean KL(original ‖ decoded) over the k+1 bins {res['fidelity_prose']['mean_kl']:.2e} (goal ≤ 1e-5).",
        "",
        f"Decode, scored shards → trainer arrays (ids int32 [P,k], logprobs float32 [P,k], tail, actual), one thread, warm: "
        f"**{res['decode_tok_s'] / 1e6:.2f} M tokens/s** (goal ≥ 1 M).",
        "",
        "| top-p (variable k, cap 64, min_k 1), same score path | bytes / scored token | scored tokens | mean kept k | goal |",
        "|---|---|---|---|---|",
    ]
    tp = res["topp"]
    goals = {"prose": "≤ 50", "math": "≤ 25"}
    for topp in TOPP:
        for name in ("prose", "math"):
            r = tp[f"{name}@{topp}"]
            lines.append(f"| top-p {topp} {name} bytes/token | **{r['bytes_per_token']:.1f}** | {r['scored_tokens']} | "
                         f"{r['mean_k']:.1f} (median {r['median_k']:.0f}, {r['share_at_cap']:.0%} at the cap) | "
                         f"{goals[name] if topp == 0.99 else '-'} |")
    m = res["megatron_layout"]
    lines += [
        "",
        "| codec vs Megatron-LM layout, fixed k=64, same prose rows | ratio | positions | ours B/token (whole shard) | "
        "Megatron-LM layout B/token (fp16 + 16-bit ids + 17th-bit plane, zstd-3; top-k only) | goal |",
        "|---|---|---|---|---|---|",
        f"| codec vs Megatron-LM layout, 1k positions | **{m['1k']['ratio']:.2f}×** | {m['1k']['positions']} | "
        f"{m['1k']['ours_bytes_per_token']:.1f} | {m['1k']['megatron_bytes_per_token']:.1f} | ≤ 0.8× |",
        f"| codec vs Megatron-LM layout, {m['all']['positions'] / 1000:.0f}k positions | **{m['all']['ratio']:.2f}×** | "
        f"{m['all']['positions']} | {m['all']['ours_bytes_per_token']:.1f} | {m['all']['megatron_bytes_per_token']:.1f} | "
        f"≤ 0.8× |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    r = run()
    print(markdown(r))


def served_run(work: Path | None = None, prose_tokens: int = 6_000, rounds: int = 2) -> dict:
    """A served teacher vs the in-process engine: the same SmolLM2 teacher (fp32), the same prose rollouts, k=64,
    the whole `gkd score` path each time (fresh caches), rounds interleaved. The server runs with the flags the
    README gives and an API key (VLLM_API_KEY, a fresh random one; the score runs read it from the variable
    --teacher-api-key-env names), in its own process group, its log in `work`; requests go through the openai
    client (pipeline/score/served/client.py). The in-process engine stays open beside it (idle while the server scores,
    and the server idle while it does)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' server harness
    import secrets

    from transformers import AutoTokenizer
    from vllm_server import LocalServer

    teacher = teacher_dir()
    tok = AutoTokenizer.from_pretrained(teacher)
    work = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix="gkd-bench-served-"))
    rows, source = prose_rows(tok, prose_tokens)
    write_rollouts(work / "rollouts" / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint=tokenizer_fingerprint(tok))
    budget = 4096
    base = dict(rollouts=str(work / "rollouts"), teacher=str(teacher), topk=K, max_model_len=2048, batch_tokens=budget,
                part_rows=100_000)
    res: dict = {"teacher": "SmolLM2-135M-Instruct (fp32, vLLM CPU)", "k": K, "prose_source": source, "rounds": rounds}
    times: dict[str, list[float]] = {"in_process": [], "served": []}
    tokens = 0
    t = time.perf_counter()
    key = "sk-bench-" + secrets.token_hex(16)
    os.environ[BENCH_KEY_ENV] = key
    with LocalServer(teacher, work / "server.log", name="teacher", max_logprobs=K, max_model_len=2049,
                     kv_cache_gib=1.0, extra=["--max-num-batched-tokens", str(budget)],
                     env={"VLLM_API_KEY": key}) as server:
        res["server_start_s"] = time.perf_counter() - t
        args = EngineArgs(model=str(teacher), dtype="float32", max_model_len=2049, kv_cache_gib=1.0,
                          max_num_batched_tokens=budget)
        with open_engine(args, max_logprobs=K, logprobs_mode="raw_logprobs") as llm:
            for rnd in range(rounds):
                s = score(ScoreConfig(**base, cache=str(work / f"local-{rnd}")), llm=llm)
                times["in_process"].append(s["score_seconds"])
                s = score(ScoreConfig(**base, cache=str(work / f"served-{rnd}"), teacher_url=server.url,
                                      teacher_model="teacher", teacher_api_key_env=BENCH_KEY_ENV))
                times["served"].append(s["score_seconds"])
                tokens = s["tokens"]
    os.environ.pop(BENCH_KEY_ENV, None)
    med = {k: statistics.median(v) for k, v in times.items()}
    res.update(tokens=tokens, in_process_tok_s=tokens / med["in_process"], served_tok_s=tokens / med["served"],
               ratio=med["in_process"] / med["served"], seconds=times, client="openai", api_key=True)
    return res


def served_markdown(res: dict) -> str:
    return "\n".join([
        f"Teacher: {res['teacher']}, k={res['k']}, the same prose rollouts ({res['prose_source']}) through the whole "
        "`gkd score` path on one machine; served = a vLLM OpenAI server on 127.0.0.1 started with an API key, "
        "scored through the `openai` client (`--teacher-url`, `--teacher-api-key-env`), in-process = the engine in "
        "the score process.",
        "",
        "| measurement | ratio | served tokens/s | in-process tokens/s | goal |",
        "|---|---|---|---|---|",
        # one measurement, under the first cells of both issues that name it (#19 and #36)
        *(f"| {name} | **{res['ratio']:.2f}×** | {res['served_tok_s']:.0f} | {res['in_process_tok_s']:.0f} | ≥ 0.9× |"
          for name in ("served vs in-process score tokens/s", "served (openai client) vs in-process score tokens/s")),
        "",
        f"({res['tokens']} scored tokens per round, median of {res['rounds']} interleaved rounds, scoring loop only: "
        f"the server's start ({res['server_start_s']:.0f} s) and the probe are not in it.)",
    ])
