"""Trainer-side benchmarks: the loader (scored shards -> micro-batch tensors) and train-step tokens/s of the
embedded-default student (SmolLM2 6-layer, Megatron-Core, fp32, CPU), full and LoRA, on a real SmolLM2 top-64 cache.

    python -m benchmarks.run --only train

Packing is measured on two caches scored here by the real teacher (vLLM, top-64), both built from token lengths
that matter for padding, not from what the text says:
- **mixed**: reasoning-gym questions with their (short) answers beside prose pieces of 32 .. seq_length tokens, the
  spread of real SFT sets (short answers next to long traces or documents);
- **demo-like**: the demo's prompts (reasoning-gym basic_arithmetic + chain_sum in the chat template) with
  completions of 8 .. 64 tokens (the demo's max_tokens) cut from prose, the demo cache's length distribution
  without running the sampler.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from benchmarks.score_bench import prose_text
from pipeline.assets import teacher_dir
from pipeline.engine import EngineArgs, open_engine
from pipeline.score.config import ScoreConfig
from pipeline.score.scorer import score
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import rollout_row, write_rollouts

K = 64


def _math_rows(tokenizer, tasks: tuple[str, ...], per_task: int, seed: int) -> list[tuple[str, list[int], list[int]]]:
    """(prompt id, chat-templated prompt ids, answer ids + end of turn) of reasoning-gym questions."""
    import reasoning_gym

    out = []
    for task in tasks:
        for i, e in enumerate(reasoning_gym.create_dataset(task, size=per_task, seed=seed)):
            msgs = [{"role": "user", "content": e["question"]}]
            prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
            full = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": str(e["answer"])}],
                                                 tokenize=True, return_dict=False)
            out.append((f"{task}-{seed}-{i}", list(prompt), list(full[len(prompt):])))
    return out


def build_rollouts(out: Path, tokenizer, seq_length: int = 512, seed: int = 0) -> dict[str, Path]:
    """Rollout folders `mixed` and `demo` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    text, _ = prose_text()
    prose = tokenizer(text)["input_ids"]
    cursor = 0

    def cut(n: int) -> list[int]:
        nonlocal cursor
        if cursor + n > len(prose):
            cursor = 0
        cursor += n
        return prose[cursor - n : cursor]

    mixed = [rollout_row(prompt_id=pid, prompt_ids=p, completion_ids=c, source="dataset")
             for pid, p, c in _math_rows(tokenizer, ("basic_arithmetic", "chain_sum", "gsm_symbolic"), 40, seed)]
    for i in range(60):
        ids = cut(int(rng.integers(32, seq_length + 1)))
        mixed.append(rollout_row(prompt_id=f"prose-{i}", prompt_ids=ids[:1], completion_ids=ids[1:], source="dataset"))
    demo = [rollout_row(prompt_id=pid, prompt_ids=p, completion_ids=cut(int(rng.integers(8, 65))), source="student",
                        policy_version=0)
            for pid, p, _ in _math_rows(tokenizer, ("basic_arithmetic", "chain_sum"), 80, seed + 1)]
    dirs = {"mixed": out / "mixed", "demo": out / "demo"}
    fp = tokenizer_fingerprint(tokenizer)  # the score stage refuses rollouts that do not record it
    write_rollouts(dirs["mixed"] / "r-00000-of-00001.parquet", mixed, tokenizer_fingerprint=fp)
    write_rollouts(dirs["demo"] / "r-00000-of-00001.parquet", demo, tokenizer_fingerprint=fp)
    return dirs


def build_caches(work: Path, seq_length: int = 512) -> dict[str, Path]:
    """Score the `mixed` and `demo` rollouts with the embedded teacher (one vLLM engine) into two caches."""
    from transformers import AutoTokenizer

    teacher = teacher_dir()
    dirs = build_rollouts(work / "train-rollouts", AutoTokenizer.from_pretrained(teacher), seq_length)
    caches = {name: work / f"cache-{name}" for name in dirs}
    args = EngineArgs(model=str(teacher), dtype="float32", max_model_len=2049, kv_cache_gib=1.0,
                      max_num_batched_tokens=4096)
    with open_engine(args, max_logprobs=K, logprobs_mode="raw_logprobs") as llm:
        for name, rollouts in dirs.items():
            score(ScoreConfig(rollouts=str(rollouts), cache=str(caches[name]), teacher=str(teacher), topk=K,
                              max_model_len=2048, batch_tokens=4096), llm=llm)
    return caches


def _train(cache: str | Path, save: Path, steps: int, micro_batch_size: int, seq_length: int,
           extra: list[str]) -> list[dict]:
    """`gkd train` in a subprocess (the embedded student, fp32, CPU); its metrics.jsonl."""
    cmd = [sys.executable, "-m", "pipeline", "train", "student=default", f"cache=[{cache}]",
           f"micro_batch_size={micro_batch_size}", f"global_batch_size={micro_batch_size}",
           f"seq_length={seq_length}", f"train_steps={steps}", "warmup_steps=1", f"save_dir={save}",
           f"save_interval={steps}", "progress=false", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


def _steady(metrics: list[dict]) -> dict:
    """Real (non-padding) tokens per second over the steps after the first (one-off warm-up), and what they held."""
    steady = metrics[1:] or metrics
    tokens = sum(m["real_tokens"] for m in steady)
    seconds = sum(m["real_tokens"] / m["tokens_per_s"] for m in steady)
    positions = sum(m["real_tokens"] / (1 - m["padding_fraction"]) for m in steady)
    return {"steps": len(steady), "real_tokens_per_s": tokens / seconds, "padding_fraction": 1 - tokens / positions,
            "samples_per_step": sum(m["samples"] for m in steady) / len(steady)}


@functools.cache  # the fused and the unfused comparisons on one cache ask for the same rows
def padded_rows(cache: Path, micro_batch_size: int, seq_length: int) -> int:
    """Rows per padded micro-batch whose positions (rows x padded width, over an epoch) come closest to the packed
    micro-batch's micro_batch_size x seq_length: both variants then compute on the same number of positions per
    step, and the ratio of real tokens/s measures the padding removed, not a larger batch."""
    budget = micro_batch_size * seq_length
    best = (float("inf"), micro_batch_size)
    for rows in range(micro_batch_size, 8 * micro_batch_size + 1):
        p = padding(cache, rows, seq_length)
        best = min(best, (abs(p["positions_per_micro_batch"] - budget), rows))
    return best[1]


def packed_vs_padded(cache: Path, work: Path, micro_batch_size: int, seq_length: int, rounds: int,
                     extra: tuple[str, ...] = ()) -> dict:
    """Interleaved subprocess runs, padded then packed, `rounds` times; real tokens/s of each (steady steps).
    Packed: micro_batch_size rows of seq_length; padded: as many rows as give the same positions per step.
    Each run trains one epoch of the cache plus its first step (left out as warm-up), so both layouts are timed
    on the same samples: a few steps of each would time different samples, whose share of loss positions (the
    output layer's work) differs from step to step. `extra`: more `gkd train` overrides for both (e.g.
    fused_loss=false)."""
    rows = {"padded": padded_rows(cache, micro_batch_size, seq_length), "packed": micro_batch_size}
    steps = {name: epoch_steps(cache, r, seq_length, name == "packed") + 1 for name, r in rows.items()}
    runs: dict[str, list[dict]] = {"padded": [], "packed": []}
    for r in range(rounds):
        for name in runs:
            save = work / f"{cache.name}-{name}-{r}{'-'.join(('', *extra)).replace('=', '')}"
            metrics = _train(cache, save, steps[name], rows[name], seq_length, [f"packing={name == 'packed'}", *extra])
            runs[name].append(_steady(metrics))
    out = {name: {"real_tokens_per_s": float(np.median([x["real_tokens_per_s"] for x in v])),
                  "padding_fraction": float(np.mean([x["padding_fraction"] for x in v])),
                  "samples_per_step": float(np.mean([x["samples_per_step"] for x in v])),
                  "micro_batch_size": rows[name], "runs": v}
           for name, v in runs.items()}
    out["ratio"] = out["packed"]["real_tokens_per_s"] / out["padded"]["real_tokens_per_s"]
    out["ceiling"] = 1 / (1 - out["padded"]["padding_fraction"])
    out.update(micro_batch_size=micro_batch_size, seq_length=seq_length, steps=steps, rounds=rounds)
    return out


def _epoch(cache: Path, micro_batch_size: int, seq_length: int, packing: bool) -> tuple[int, Iterator]:
    """(samples in the cache, the micro-batches of one epoch): the layout's own order from position 0 (the
    trainer's seed), up to the micro-batch that hands out the cache's last sample."""
    from pipeline.train.data.loader import ScoredLoader

    loader = ScoredLoader([cache], micro_batch_size=micro_batch_size, seq_length=seq_length, seed=1234,
                          packing=packing)

    def batches() -> Iterator:
        for mb in loader.iter_from(0, prefetch=0):
            yield mb
            if mb.end >= loader.num_samples:
                return

    return loader.num_samples, batches()


def epoch_steps(cache: Path, micro_batch_size: int, seq_length: int, packing: bool) -> int:
    """Micro-batches (= optimizer steps at global_batch_size = micro_batch_size) until the loader has handed out
    every sample of the cache once."""
    return sum(1 for _ in _epoch(cache, micro_batch_size, seq_length, packing)[1])


def padding(cache: Path, micro_batch_size: int, seq_length: int) -> dict:
    """Padding fraction of one epoch, padded vs packed, from the loader (no training)."""
    out = {}
    for packing in (False, True):
        samples, batches = _epoch(cache, micro_batch_size, seq_length, packing)
        tokens = positions = count = 0
        for mb in batches:
            tokens, positions, count = tokens + mb.tokens, positions + mb.positions, count + 1
        out["packed" if packing else "padded"] = 1 - tokens / positions
        if not packing:
            out["positions_per_micro_batch"] = positions / count
    out.update(micro_batch_size=micro_batch_size, seq_length=seq_length, samples=samples)
    return out


def loader_throughput(sources: Sequence[str | Path], *, micro_batch_size: int = 8, seq_length: int = 512,
              epochs: int = 5, seed: int = 0, packing: bool = False) -> dict:
    """Loader throughput on one core (no prefetch thread): scored shards -> micro-batch tensors, `epochs` epochs
    with the decoded-block LRU emptied before each, so every row is read and decoded every epoch (a small cache
    fits in the LRU, and repeated epochs would otherwise measure batch assembly only). Opening the shards and
    building the sample order are not timed; packing plans are. `tokens_per_s` is per CPU-second of the process
    (all its threads: what one core does, whatever else the machine runs); `wall_tokens_per_s` by the clock."""
    from pipeline.train.data.loader import ScoredLoader

    loader = ScoredLoader(sources, micro_batch_size=micro_batch_size, seq_length=seq_length, seed=seed,
                          packing=packing)
    batches = loader.iter_from(0, prefetch=0)
    loader.micro_batch(0)  # the decode kernel's one-off compile (or load from numba's disk cache): not timed
    tokens = scored = positions = 0
    cpu = wall = 0.0
    for e in range(epochs):
        loader.reader.blocks.clear()
        c0, w0 = time.process_time(), time.perf_counter()
        while True:
            mb = next(batches)
            tokens += mb.tokens
            positions += mb.positions
            scored += int(mb.loss_mask.sum())
            if mb.end >= (e + 1) * loader.num_samples:
                break
        cpu += time.process_time() - c0
        wall += time.perf_counter() - w0
    return {"k": loader.k, "tokens_per_s": tokens / cpu, "scored_tokens_per_s": scored / cpu,
            "wall_tokens_per_s": tokens / wall, "cpu_seconds": cpu, "wall_seconds": wall, "epochs": epochs,
            "samples": loader.num_samples, "packing": packing, "padding_fraction": 1 - tokens / positions,
            "micro_batch_size": micro_batch_size, "seq_length": seq_length}


def _loader(cache: str | Path, micro_batch_size: int, seq_length: int, rounds: int) -> dict:
    """Loader throughput, padded and packed, in interleaved rounds: per layout the round with the median tokens/s
    (with every round's figure under "rounds"). One measurement right after the score bench read 0.84M where the
    same call gave 0.96M and then 1.22-1.29M a minute later: the machine's speed drifts, a median of rounds less."""
    runs: dict[str, list[dict]] = {"padded": [], "packed": []}
    for _ in range(rounds):
        for name, out in runs.items():
            out.append(loader_throughput([cache], micro_batch_size=micro_batch_size, seq_length=seq_length,
                                 packing=name == "packed"))
    result = {}
    for name, out in runs.items():
        ranked = sorted(out, key=lambda r: r["tokens_per_s"])
        result[name] = {**ranked[len(ranked) // 2], "rounds": [r["tokens_per_s"] for r in out]}
    return result


def run(cache: str | Path, work: Path, steps: int = 3, micro_batch_size: int = 8, seq_length: int = 512,
        pack_micro_batch_size: int = 4, rounds: int = 2) -> dict:
    """`cache`: the prose cache of the score bench (loader, train step); the packing caches are built here."""
    from benchmarks import step_bench

    res: dict = {"loader": _loader(cache, micro_batch_size, seq_length, rounds=3)}
    for name, extra in (("train", []), ("train_lora", ["lora.rank=16", "lora.alpha=32"])):
        save = work / f"{name}-bench"
        metrics = _train(cache, save, steps, micro_batch_size, seq_length, ["packing=false", *extra])
        steady = metrics[1:] or metrics  # the first step includes one-off warm-up
        res[name] = {"steps": len(metrics), "micro_batch_size": micro_batch_size, "seq_length": seq_length,
                     "tokens_per_s": sum(m["tokens_per_s"] for m in steady) / len(steady),
                     "checkpoint_bytes": sum(f.stat().st_size for f in (save / f"step_{steps:07d}").rglob("*")
                                             if f.is_file())}
    res["compute"] = step_bench.run(cache)  # attention backend; our step vs a plain transformers loop
    caches = build_caches(work, seq_length)
    res["packing"] = {name: packed_vs_padded(c, work, pack_micro_batch_size, seq_length, rounds)
                      for name, c in caches.items()}
    # The fused loss runs the output layer on loss positions only, so padding costs the padded run its transformer
    # layers but not its largest matmul; with logits on every position (fused_loss=false, the unfused trainers'
    # layout) padding costs everything, which is the case the ceiling 1/(1 - padding) describes.
    res["packing_unfused"] = packed_vs_padded(caches["mixed"], work, pack_micro_batch_size, seq_length, rounds,
                                              extra=("fused_loss=false",))
    # The same on the demo-like cache, whose loss positions (the completions) are about a third of its tokens: with
    # the fused loss their output-layer work, the same in both layouts, keeps the ratio well under the ceiling.
    res["packing_demo_unfused"] = packed_vs_padded(caches["demo"], work, pack_micro_batch_size, seq_length, rounds,
                                                   extra=("fused_loss=false",))
    res["padding_demo"] = [padding(caches["demo"], 8, 256), padding(caches["demo"], 8, 512)]
    res["padding_mixed"] = padding(caches["mixed"], pack_micro_batch_size, seq_length)
    return res


def markdown(res: dict) -> str:
    from benchmarks import step_bench

    ld, tr, pk = res["loader"], res["train"], res["packing"]
    mixed, demo = pk["mixed"], pk["demo"]
    unfused, demo_unfused = res["packing_unfused"], res["packing_demo_unfused"]
    d256, d512 = res["padding_demo"]

    def pct(x: float) -> str:
        return f"{100 * x:.1f} %"

    def pad_cap(p: dict) -> float:
        """Share of the ceiling left when everything scales with positions but the packed rows still pad:
        (1 - packed padding) / (1 - padded padding) over 1 / (1 - padded padding)."""
        return 1 - p["packed"]["padding_fraction"]

    def pack_cell(p: dict) -> str:
        return (f"**{p['ratio']:.2f}×** (packed {p['packed']['real_tokens_per_s']:.0f} vs padded "
                f"{p['padded']['real_tokens_per_s']:.0f} real tokens/s; padding {pct(p['padded']['padding_fraction'])}"
                f" → {pct(p['packed']['padding_fraction'])}; {p['packed']['samples_per_step']:.1f} vs "
                f"{p['padded']['samples_per_step']:.0f} samples in {p['packed']['micro_batch_size']} vs "
                f"{p['padded']['micro_batch_size']} rows per step)")

    return "\n".join([
        "| trainer side (real SmolLM2 top-64 caches) | measured | goal |",
        "|---|---|---|",
        f"| loader | **{ld['packed']['tokens_per_s']:.0f}** tokens/s packed, {ld['padded']['tokens_per_s']:.0f} padded "
        f"(median of {len(ld['packed']['rounds'])} interleaved rounds; packed rounds "
        f"{', '.join(f'{x / 1e6:.2f}M' for x in ld['packed']['rounds'])}; "
        f"scored shards → micro-batch tensors, k={ld['packed']['k']}, one core, no prefetch thread, "
        f"{ld['packed']['epochs']} epochs of {ld['packed']['samples']} samples each decoded afresh, micro-batch "
        f"{ld['packed']['micro_batch_size']} × {ld['packed']['seq_length']}; per CPU-second of the process; by the "
        f"clock on this shared machine {ld['packed']['wall_tokens_per_s']:.0f}) | ≥ 1,000,000 |",
        f"| packed vs padded train tokens/s | {pack_cell(mixed)} on the mixed cache (reasoning-gym answers + prose of "
        f"32..{mixed['seq_length']} tokens), default fused loss, which already skips padding in the output layer "
        f"(ceiling 1/(1 − padding) = {mixed['ceiling']:.2f}× applies to the next row) | ≥ 1.7× |",
        f"| packed vs padded, unfused loss (logits on every position) | {pack_cell(unfused)}: "
        f"{100 * unfused['ratio'] / unfused['ceiling']:.0f} % of the ceiling {unfused['ceiling']:.2f}×; packed + "
        f"fused {mixed['packed']['real_tokens_per_s']:.0f} vs padded + unfused "
        f"{unfused['padded']['real_tokens_per_s']:.0f} real tokens/s = "
        f"{mixed['packed']['real_tokens_per_s'] / unfused['padded']['real_tokens_per_s']:.2f}× | (report) |",
        f"| packed vs padded, demo-like cache, share of the ceiling | **{100 * demo['ratio'] / demo['ceiling']:.0f} %** "
        f"of the ceiling 1/(1 − padding) = {demo['ceiling']:.2f}×, default fused loss: {pack_cell(demo)}; unfused "
        f"loss (logits on every position, where the ceiling's premise holds): "
        f"{100 * demo_unfused['ratio'] / demo_unfused['ceiling']:.0f} % ({demo_unfused['ratio']:.2f}×: packed "
        f"{demo_unfused['packed']['real_tokens_per_s']:.0f} vs padded {demo_unfused['padded']['real_tokens_per_s']:.0f} "
        f"real tokens/s); the packed rows' own padding caps any run at {100 * pad_cap(demo):.0f} % | ≥ 95 % |",
        f"| padding fraction, demo-like cache ({d256['samples']} samples) | micro-batch {d256['micro_batch_size']} × "
        f"{d256['seq_length']} (the demo's): {pct(d256['padded'])} padded → {pct(d256['packed'])} packed; "
        f"{d512['micro_batch_size']} × {d512['seq_length']}: {pct(d512['padded'])} → {pct(d512['packed'])} | (report) |",
        f"| train step, SmolLM2 6-layer student, micro-batch {tr['micro_batch_size']}, seq ≤ {tr['seq_length']}, "
        f"padded, fp32 CPU | {tr['tokens_per_s']:.0f} tokens/s | (report) |",
        f"| same, LoRA rank 16 on all linear layers (base frozen) | {res['train_lora']['tokens_per_s']:.0f} tokens/s "
        f"({res['train_lora']['tokens_per_s'] / tr['tokens_per_s']:.2f}× full) | (report) |",
        *step_bench.markdown(res["compute"]),  # sdpa vs local; our step vs plain transformers
        "",
        f"Packed vs padded: embedded student, fp32 CPU, packed micro-batch {mixed['micro_batch_size']} rows of "
        f"{mixed['seq_length']} tokens; the padded runs get as many rows as give the same positions per step (so the "
        f"ratio is the padding removed, not a larger batch); each run trains one epoch of its cache plus the "
        f"first step, which is left out as warm-up, so both layouts are timed on the same samples (mixed: "
        f"{mixed['steps']['padded']} padded / {mixed['steps']['packed']} packed steps per run; demo-like: "
        f"{demo['steps']['padded']} / {demo['steps']['packed']}); subprocess runs interleaved, {mixed['rounds']} "
        "round(s). Both caches scored here by the teacher (benchmarks/train_bench.py).",
        "",
        f"Checkpoint size (model + optimizer state): full {tr['checkpoint_bytes'] / 2**20:.0f} MiB, LoRA "
        f"{res['train_lora']['checkpoint_bytes'] / 2**20:.1f} MiB (adapter and its Adam moments only).",
    ])
