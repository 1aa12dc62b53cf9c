"""The exact teacher from a cache (issue #50): hidden-state cache bytes and train step time against top-64.

    python -m benchmarks.run --only exact          (~30 min on 2 CPU cores)

The embedded teacher (SmolLM2-135M-Instruct: hidden 576, vocabulary 49,152, tied embeddings) scores the same
rollouts twice through vLLM: `teacher_rows=hidden` (bf16 final hidden states through the pooling runner, the output
layer once) and `--topk 64` (the default codec). The rollouts are prose: the project's own docs cut into 96-token
completions after a short prompt (dataset-sourced), 48 of them. Bytes: each cache's shard bytes per scored position
(`gkd cache stats`), the output layer counted apart (it is stored once, whatever the cache's size). Step: the demo
student (6 of the teacher's 30 layers) trained by `gkd train` from each cache, same seed, samples and steps,
`loss=gkd beta=1` (reverse KL: exact from the hidden cache, the top-64 tail bins from the other), fused output layer,
one intra-op thread each; the median step seconds after the first two, two runs of each interleaved.
The SFT step: the same runs from the top-64 cache with `kd_alpha=0 sft_alpha=1` (plain CE on the same dataset rows,
same loop and fused output layer). Quality: the demo student trained 36 steps from each cache at beta=1 and at
beta=0, exported, and judged on 8 held-out documents by the exact reverse and forward KL to the teacher.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from pipeline.assets import student_dir, teacher_dir
from pipeline.score.config import ScoreConfig
from pipeline.score.scorer import score
from pipeline.store import TeacherCache
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import rollout_row, write_rollouts

ROOT = Path(__file__).resolve().parents[1]
SAMPLES, COMPLETION = 48, 96
STEPS = 8


def rollouts(work: Path, teacher: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    text = "\n".join((ROOT / "docs" / n).read_text() for n in ("architecture.md", "dependencies.md", "tuning.md"))
    ids = tok(text)["input_ids"]
    prompt = tok("Continue the design notes:\n")["input_ids"]
    rows = [rollout_row(prompt_id=f"doc{i}", prompt_ids=prompt, completion_ids=ids[i * COMPLETION:(i + 1) * COMPLETION],
                        source="dataset") for i in range(SAMPLES)]
    out = work / "rollouts"
    write_rollouts(out / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint=tokenizer_fingerprint(teacher))
    return out


def _train(cache: Path, save: Path, steps: int = STEPS, **kw) -> list[dict]:
    args = dict(student=str(student_dir()), cache=f"[{cache}]", micro_batch_size=4, global_batch_size=4,
                seq_length=128, train_steps=steps, lr=1e-4, warmup_steps=1, save_interval=steps * 10,
                save_dir=str(save), progress=False, seed=1, beta=1.0, packing=False)
    args.update(kw)
    subprocess.run([sys.executable, "-m", "pipeline", "train", *[f"{k}={v}" for k, v in args.items()]], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


HELD_OUT = 8  # documents after the trained ones
QUALITY_STEPS = 36


def held_out_kl(teacher: Path, student: Path, rows: list[list[int]], prompt: list[int]) -> dict:
    """Mean per-position reverse KL(s‖p) and forward KL(p‖s) over the held-out completions, full vocabulary, fp32
    transformers forwards of the teacher and the exported student."""
    import torch
    from transformers import AutoModelForCausalLM

    models = [AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval() for m in (teacher, student)]
    rev, fwd = [], []
    with torch.no_grad():
        for comp in rows:
            ids = torch.tensor([prompt + comp])
            pos = slice(len(prompt) - 1, ids.shape[1] - 1)
            lp, ls = (torch.log_softmax(m(ids).logits[0, pos], -1) for m in models)
            rev.append((ls.exp() * (ls - lp)).sum(-1))
            fwd.append((lp.exp() * (lp - ls)).sum(-1))
    return {"reverse_kl": float(torch.cat(rev).mean()), "forward_kl": float(torch.cat(fwd).mean())}


def quality(work: Path, beta: float = 1.0) -> dict:
    """The demo student trained QUALITY_STEPS steps at `beta` from each cache (same seed, samples, lr), exported,
    judged on held-out documents by the exact reverse and forward KL to the teacher."""
    from transformers import AutoTokenizer

    from pipeline.train.checkpoint import step_dir

    teacher = teacher_dir()
    tok = AutoTokenizer.from_pretrained(teacher)
    text = "\n".join((ROOT / "docs" / n).read_text() for n in ("architecture.md", "dependencies.md", "tuning.md"))
    ids = tok(text)["input_ids"]
    prompt = tok("Continue the design notes:\n")["input_ids"]
    held = [ids[i * COMPLETION:(i + 1) * COMPLETION] for i in range(SAMPLES, SAMPLES + HELD_OUT)]
    out = {"steps": QUALITY_STEPS, "beta": beta, "held_out_positions": HELD_OUT * COMPLETION}
    for name in ("hidden", "top64"):
        save = work / f"quality-{name}-beta{beta:g}"
        _train(work / name, save, QUALITY_STEPS, lr=5e-4, warmup_steps=2, beta=beta)
        export = work / f"quality-{name}-beta{beta:g}-hf"
        subprocess.run([sys.executable, "-m", "pipeline", "export", "--checkpoint", str(step_dir(save, QUALITY_STEPS)),
                        "--out", str(export)], check=True, stdout=subprocess.DEVNULL)
        out[name] = held_out_kl(teacher, export, held, prompt)
    out["untrained"] = held_out_kl(teacher, student_dir(), held, prompt)
    out["reverse_ratio"] = out["hidden"]["reverse_kl"] / out["top64"]["reverse_kl"]
    out["forward_ratio"] = out["hidden"]["forward_kl"] / out["top64"]["forward_kl"]
    return out


def run(work: Path) -> dict:
    import time

    work.mkdir(parents=True, exist_ok=True)
    teacher = teacher_dir()
    src = rollouts(work, teacher)
    res: dict = {"samples": SAMPLES, "completion_tokens": COMPLETION}
    for name, kw in (("hidden", {"teacher_rows": "hidden"}), ("top64", {"topk": 64})):
        t0 = time.time()
        summary = score(ScoreConfig(rollouts=str(src), cache=str(work / name), teacher=str(teacher), max_model_len=512,
                                    enforce_eager=True, **kw))
        stats = TeacherCache.open(work / name).stats()
        res[name] = {"bytes_per_position": stats["bytes_per_position"], "scored_tokens": stats["scored_tokens"],
                     "score_seconds": summary.get("score_seconds"), "wall_seconds": round(time.time() - t0, 1)}
    res["vocab"] = TeacherCache.open(work / "hidden").descriptor.vocab_size
    layer = work / "hidden" / "output_layer.safetensors"
    res["hidden"]["output_layer_bytes"] = layer.stat().st_size
    res["bytes_ratio"] = res["hidden"]["bytes_per_position"] / res["top64"]["bytes_per_position"]
    # sft: the same student, samples and steps from the top-64 cache with kd_alpha=0 sft_alpha=1 (plain CE on these
    # dataset rows through the same loop and fused output layer: what a step costs with no teacher at all)
    runs = {"top64": ("top64", {}), "hidden": ("hidden", {}), "sft": ("top64", {"kd_alpha": 0, "sft_alpha": 1})}
    steps: dict[str, list[float]] = {k: [] for k in runs}
    last: dict[str, dict] = {}
    for rep in range(2):
        for name, (cache, kw) in runs.items():
            rows = _train(work / cache, work / f"run-{name}-{rep}", **kw)
            steps[name] += [r["step_seconds"] for r in rows[2:]]
            last[name] = rows[-1]
    res["step_seconds"] = {k: statistics.median(v) for k, v in steps.items()}
    res["step_ratio"] = res["step_seconds"]["hidden"] / res["step_seconds"]["top64"]
    res["gkd_vs_sft_ratio"] = res["step_seconds"]["top64"] / res["step_seconds"]["sft"]
    res["quality"] = {f"beta{b:g}": quality(work, b) for b in (1.0, 0.0)}
    res["last_step"] = {k: {m: v.get(m) for m in ("loss", "jsd", "sft", "tokens_per_s")} for k, v in last.items()}
    return res


def markdown(res: dict) -> str:
    h, t = res["hidden"], res["top64"]
    full = res.get("vocab", 49152) * 4  # the full-vocabulary fp32 logits of one position, raw
    return "\n".join([
        "| measure | value | goal |", "|---|---|---|",
        f"| hidden-state cache bytes per position vs top-64 | {res['bytes_ratio']:.1f}x ({h['bytes_per_position']:.0f} vs "
        f"{t['bytes_per_position']:.1f} B per scored position; SmolLM2-135M, hidden 576 in bf16 = 1,152 B raw; plus the "
        f"output layer once, {h['output_layer_bytes'] / 2**20:.1f} MiB; full fp32 logits would be {full:,} B raw, "
        f"{full / h['bytes_per_position']:.0f}x the hidden rows) | report |",
        f"| exact-teacher train step vs top-64 train step | {res['step_ratio']:.2f}x ({res['step_seconds']['hidden']:.2f} vs "
        f"{res['step_seconds']['top64']:.2f} s, demo student, 4 x 128 tokens, reverse KL, fused, 1 thread) | <= 1.3x |",
        f"| top-64 gkd step vs sft step, same student and tokens | {res['gkd_vs_sft_ratio']:.2f}x "
        f"({res['step_seconds']['top64']:.2f} vs {res['step_seconds']['sft']:.2f} s; sft: kd_alpha=0 sft_alpha=1 on the "
        f"same dataset rows, fused CE, the teacher rows read but no teacher column in the kernel) | <= 1.10x |",
        *_quality_rows(res["quality"]),
        f"| hidden vs top-64 scoring wall time, {h['scored_tokens']} positions | {h['wall_seconds']:.0f} vs "
        f"{t['wall_seconds']:.0f} s (engine start included) | report |",
    ])


def _quality_rows(q: dict) -> list[str]:
    b1, b0 = q["beta1"], q["beta0"]
    setup = (f"demo student, {b1['steps']} steps of 4 x 128 tokens at lr 5e-4 from each cache, seed 1; "
             f"{b1['held_out_positions']} held-out positions, exact full-vocabulary KL from fp32 forwards")
    return [
        f"| exact vs top-64 tail, held-out reverse KL after training at beta=1 | {b1['reverse_ratio']:.2f}x "
        f"({b1['hidden']['reverse_kl']:.3f} vs {b1['top64']['reverse_kl']:.3f} nats/position; untrained "
        f"{b1['untrained']['reverse_kl']:.3f}; {setup}) | <= 0.90x |",
        f"| exact vs top-64 tail, held-out forward KL after training at beta=0 | {b0['forward_ratio']:.2f}x "
        f"({b0['hidden']['forward_kl']:.3f} vs {b0['top64']['forward_kl']:.3f} nats/position; untrained "
        f"{b0['untrained']['forward_kl']:.3f}; same setup at beta=0) | report |",
    ]


if __name__ == "__main__":
    import tempfile

    out = run(Path(tempfile.mkdtemp(prefix="gkd-exact-")))
    print(json.dumps(out, indent=1))
    print(markdown(out))
