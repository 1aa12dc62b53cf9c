"""`make demo`: the whole offline pipeline on a real pretrained teacher, on a CPU, with a report and a picture.

    gkd demo                 # = make demo (SmolLM2-135M-Instruct teacher, 6-layer student)
    gkd demo --quick         # a reduced run (fewer prompts and steps)

Like the on-policy driver this is orchestration above the stages, so it calls their public functions:
  1. import reference answers of seeded reasoning-gym problems as dataset rollouts   (gkd import)
  2. sample student rollouts with vLLM                                               (gkd generate)
  3. score everything with the teacher into one cache                                (gkd score)
  4. train student A (Megatron-Core) from the cache in one run that saves every eval_every steps; each of those
     checkpoints is exported and its held-out KL measured                             (gkd train / gkd export)
  5. train student B (another seed) from the same cache: the score stage has nothing left to do
  6. write report.json and report.png in the output folder
Training runs in subprocesses (`python -m pipeline train`), exactly as a user would run it. A rerun reuses the
rollouts and caches (steps 1-3 find their outputs complete) and trains the students afresh. The entry (`gkd demo`,
`python -m pipeline.demo_run`) is pipeline/demo_run.py.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.assets import resolve_student, resolve_teacher
from pipeline.engine import EngineArgs, open_engine
from pipeline.evaluate import heldout_kl, load_hf
from pipeline.generate.importer import import_rows
from pipeline.generate.prompts import load_prompts
from pipeline.generate.sampler import GenerateConfig, output_path, run_task
from pipeline.score.config import ScoreConfig
from pipeline.score.scorer import score
from pipeline.score.teacher import engine_length, teacher_engine_args
from pipeline.store import TeacherCache
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import iter_rollouts, rollout_shards, shard_path, write_rollouts
from pipeline.store.shards import marker_path


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    teacher: str | None = None  # None: SmolLM2-135M-Instruct from pipeline.assets
    student: str | None = None  # None: its 6-layer pruned copy
    tasks: str = "basic_arithmetic,chain_sum"
    train_prompts: int = 40  # per task
    eval_prompts: int = 8  # per task, other seed
    samples_per_prompt: int = 2
    max_tokens: int = 64
    topk: int = 64
    # 100 steps of 2 packed rows of 256 tokens (about 5 samples a step, 2 epochs) at lr 1e-3: the best held-out KL
    # of the schedules tried for about the same time (docs/tuning.md)
    steps: int = 100
    eval_every: int = 25
    second_run_steps: int = 20
    micro_batch_size: int = 2  # rows of seq_length tokens, packed (about 5 samples a step)
    seq_length: int = 256
    lr: float = 1e-3
    live_probe_steps: int = 3  # a short run with the live teacher on the same rollouts: the break-even's L
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True


QUICK = dict(train_prompts=6, eval_prompts=3, samples_per_prompt=1, max_tokens=24, steps=4, eval_every=2,
             second_run_steps=2, micro_batch_size=2, live_probe_steps=2)


def _sh(cmd: list[str], log: Path) -> None:
    """Run a stage CLI in a subprocess: its progress bar (stderr) on the terminal, its stdout kept in a log file."""
    print(f"[demo] $ {' '.join(cmd)}", flush=True)
    with open(log, "a") as f:
        proc = subprocess.run(cmd, stdout=f)
    if proc.returncode:
        raise RuntimeError(f"{cmd[3]} failed (exit {proc.returncode}); see the messages above and {log}")


def heldout_metrics(student_dir: Path, eval_cache: Path, teacher_answers: list[tuple[list[int], list[int]]]) -> dict:
    """KL(teacher || student) over the teacher top-k + tail bin on held-out student samples (the on-policy driver's
    measure, pipeline/evaluate.py), and the student's NLL of teacher-generated answers."""
    import torch

    model = load_hf(student_dir)
    kl = heldout_kl(model, eval_cache)
    nll = []
    with torch.no_grad():
        for prompt, completion in teacher_answers:
            ids = torch.tensor([prompt + completion])
            logp = torch.log_softmax(model(ids).logits[0], -1)
            pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
            nll.append(-logp[pos, ids[0, pos + 1]])
    return {"heldout_kl": kl["heldout_kl"], "top1_agreement": kl["top1_agreement"],
            "heldout_nll_teacher_answers": float(torch.cat(nll).mean()),
            "kl_positions": kl["heldout_tokens"], "nll_tokens": int(sum(len(n) for n in nll))}


ACCURACY_GATE = 0.20  # below this teacher accuracy a task score says nothing about distillation


def answer_accuracy(rollouts: list[dict], tokenizer) -> float:
    """Fraction of reasoning-gym answers whose last number equals the reference answer's (loose matching: the
    small models answer in prose). `rollouts`: rows with prompt_id `rg:TASK:SEED:I` and a completion."""
    import re

    import reasoning_gym

    number = re.compile(r"-?\d+(?:\.\d+)?")
    datasets: dict[tuple[str, int], list] = {}
    hits = 0
    for r in rollouts:
        _, task, seed, i = r["prompt_id"].split(":")
        if (task, int(seed)) not in datasets:
            size = 1 + max(int(x["prompt_id"].split(":")[3]) for x in rollouts if x["prompt_id"].split(":")[1] == task)
            datasets[task, int(seed)] = list(reasoning_gym.create_dataset(task, size=size, seed=int(seed)))
        want = number.findall(str(datasets[task, int(seed)][int(i)]["answer"]))
        got = number.findall(tokenizer.decode(r["completion_ids"], skip_special_tokens=True))
        hits += bool(want and got and float(got[-1]) == float(want[-1]))
    return hits / max(len(rollouts), 1)


@dataclass
class Prepared:
    """What steps 1-3 leave on disk (each step skipped where its outputs are complete): the inputs of training."""
    out: Path
    teacher: Path
    student: Path
    train_rollouts: Path  # imported answers + student samples
    teacher_answers: Path  # the teacher's greedy answers to the held-out prompts (for NLL and task accuracy)
    answers: list[tuple[list[int], list[int]]]
    score_config: dict  # the ScoreConfig settings the caches were scored with
    first_score: dict  # what the first score of the training rollouts reported
    times: dict[str, float]
    tokenizer: Any
    eval_prompts: str  # the held-out prompts' source
    teacher_engine: EngineArgs  # how the caches' teacher engine was opened (a bench scoring more rows reuses it)


def prepare(cfg: DemoConfig) -> Prepared:
    """Steps 1-3: import, generate, score into out/cache (training) and out/cache-eval (held-out student samples)."""
    from transformers import AutoTokenizer

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t = time.perf_counter()
    teacher, student = resolve_teacher(cfg.teacher), resolve_student(cfg.student)
    times["assets"] = time.perf_counter() - t
    tok = AutoTokenizer.from_pretrained(student)
    train_src = f"reasoning-gym:{cfg.tasks}?size={cfg.train_prompts}&seed=0"
    eval_src = f"reasoning-gym:{cfg.tasks}?size={cfg.eval_prompts}&seed=12345"

    # 1. dataset responses -> off-policy rollouts
    t = time.perf_counter()
    train_dir = out / "rollouts" / "train"
    ds_path = shard_path(train_dir, "dataset", 0, 1)
    if not ds_path.exists():
        rows, _ = import_rows(tok, load_prompts(train_src), where=train_src)
        write_rollouts(ds_path, rows, tokenizer_fingerprint=tokenizer_fingerprint(tok))
    times["import"] = time.perf_counter() - t

    # 2. student samples (training rollouts and held-out samples), one engine
    t = time.perf_counter()
    gen = dict(student=str(student), n=cfg.samples_per_prompt, max_tokens=cfg.max_tokens, temperature=1.0,
               kv_cache_gib=cfg.kv_cache_gib, enforce_eager=cfg.enforce_eager, dtype="float32")
    jobs = [GenerateConfig(prompts=train_src, out=str(train_dir), seed=0, **gen),
            GenerateConfig(prompts=eval_src, out=str(out / "rollouts" / "eval-student"), seed=1, **gen)]
    if not all(marker_path(output_path(j, 0)).exists() for j in jobs):
        engine = EngineArgs(model=str(student), dtype="float32", max_model_len=1024, kv_cache_gib=cfg.kv_cache_gib,
                            enforce_eager=cfg.enforce_eager)
        with open_engine(engine) as llm:
            for j in jobs:
                if not marker_path(output_path(j, 0)).exists():
                    run_task(llm, tok, j, 0)
    times["generate"] = time.perf_counter() - t

    # 3. the teacher: answers to the held-out prompts (for NLL), then score train and eval rollouts
    t = time.perf_counter()
    sc = dict(teacher=str(teacher), topk=cfg.topk, max_model_len=1024, kv_cache_gib=cfg.kv_cache_gib,
              enforce_eager=cfg.enforce_eager, batch_tokens=4096)
    from transformers import AutoConfig

    # the score stage's own engine rule (1,025 positions: one sampled token after a 1,024-token sequence)
    scfg = ScoreConfig(**sc)
    engine = teacher_engine_args(scfg, teacher, engine_length(scfg, AutoConfig.from_pretrained(teacher)))
    teacher_ans = GenerateConfig(prompts=eval_src, out=str(out / "rollouts" / "eval-teacher"), student=str(teacher),
                                 n=1, max_tokens=cfg.max_tokens, temperature=0.0, seed=2, dtype="float32")
    with open_engine(engine, max_logprobs=cfg.topk, logprobs_mode="raw_logprobs") as llm:
        if not marker_path(output_path(teacher_ans, 0)).exists():
            run_task(llm, tok, teacher_ans, 0)
        t_score = time.perf_counter()
        first = score(ScoreConfig(rollouts=str(train_dir), cache=str(out / "cache"), **sc), llm=llm)
        times["score_train"] = time.perf_counter() - t_score
        score(ScoreConfig(rollouts=str(out / "rollouts" / "eval-student"), cache=str(out / "cache-eval"), **sc), llm=llm)
    times["teacher"] = time.perf_counter() - t
    answers = [(r["prompt_ids"], r["completion_ids"]) for r in iter_rollouts(rollout_shards(teacher_ans.out))]

    return Prepared(out=out, teacher=teacher, student=student, train_rollouts=train_dir,
                    teacher_answers=Path(teacher_ans.out), answers=answers, score_config=sc, first_score=first,
                    times=times, tokenizer=tok, eval_prompts=eval_src, teacher_engine=engine)


def train_args(cfg: DemoConfig, student: Path, cache: Path) -> list[str]:
    """`gkd train` settings of every demo student (and of the bench that compares caches through the demo)."""
    return [f"student={student}", f"cache=[{cache}]", f"micro_batch_size={cfg.micro_batch_size}",
            f"global_batch_size={cfg.micro_batch_size}", f"seq_length={cfg.seq_length}", f"lr={cfg.lr}",
            f"min_lr={cfg.lr / 10}", f"warmup_steps={max(1, cfg.steps // 10)}", "beta=0.0", "topk_mode=tail"]


def run(cfg: DemoConfig) -> dict:
    from pipeline.train.checkpoint import step_dir  # torch: not at module top (the CLI imports this module)

    p = prepare(cfg)
    out, teacher, student, train_dir, times, answers = p.out, p.teacher, p.student, p.train_rollouts, p.times, p.answers
    sc, first, log, tok, eval_src = p.score_config, p.first_score, p.out / "demo.log", p.tokenizer, p.eval_prompts

    # 4. student A in one training run that saves every eval_every steps, then each checkpoint exported to HF and
    # evaluated. The students are trained afresh on every demo run (the caches are what is reused), so a rerun's
    # curve and train time are measured, not resumed from an earlier run's last checkpoint.
    for d in ("student-a", "student-a-hf", "live-probe", "student-b"):
        shutil.rmtree(out / d, ignore_errors=True)
    curve = [{"step": 0, **heldout_metrics(student, out / "cache-eval", answers)}]
    py = [sys.executable, "-m", "pipeline"]
    t = time.perf_counter()
    args = train_args(cfg, student, out / "cache")
    _sh(py + ["train", *args, "seed=1", f"train_steps={cfg.steps}", f"save_dir={out / 'student-a'}",
              f"save_interval={cfg.eval_every}"], log)
    times["train_a"] = time.perf_counter() - t
    export_dir = out / "student-a-hf"
    # every eval_every steps, and the last step (the report's "after") when steps is not a multiple of it
    for step in sorted({*range(cfg.eval_every, cfg.steps + 1, cfg.eval_every), cfg.steps}):
        _sh(py + ["export", "--checkpoint", str(step_dir(out / "student-a", step)), "--out", str(export_dir)], log)
        curve.append({"step": step, **heldout_metrics(export_dir, out / "cache-eval", answers)})
        print(f"[demo] step {step}: held-out KL {curve[-1]['heldout_kl']:.3f} nats", flush=True)
    times["train_a_with_evals"] = time.perf_counter() - t

    # 4b. the same training with a live teacher, a few steps: the per-step cost the cache saves (break-even's L)
    t = time.perf_counter()
    _sh(py + ["train", *[a for a in args if not a.startswith("cache=")], "cache=[]", f"teacher_live={teacher}",
              f"rollouts=[{train_dir}]", f"teacher_live_topk={cfg.topk}", "seed=1",
              f"train_steps={cfg.steps}", f"exit_after={cfg.live_probe_steps}", f"save_dir={out / 'live-probe'}",
              f"save_interval={cfg.live_probe_steps}"], log)  # student A's schedule, its first steps: like for like
    times["live_probe"] = time.perf_counter() - t

    # 5. student B from the same cache: scoring again finds every key cached
    t = time.perf_counter()
    again = score(ScoreConfig(rollouts=str(train_dir), cache=str(out / "cache"), **sc))
    times["score_again"] = time.perf_counter() - t
    t = time.perf_counter()
    _sh(py + ["train", *args, "seed=2", f"train_steps={cfg.second_run_steps}", f"save_dir={out / 'student-b'}",
              f"save_interval={cfg.second_run_steps}"], log)
    times["train_b"] = time.perf_counter() - t

    # 6. report
    stats = TeacherCache.open(out / "cache").stats()
    metrics_a = [json.loads(line) for line in open(out / "student-a" / "metrics.jsonl")]
    metrics_b = [json.loads(line) for line in open(out / "student-b" / "metrics.jsonl")]
    metrics_live = [json.loads(line) for line in open(out / "live-probe" / "metrics.jsonl")]
    kl0, kl1 = curve[0]["heldout_kl"], curve[-1]["heldout_kl"]
    # Break-even from measured seconds: the teacher pass S (this run's score of the training rollouts) against
    # the extra seconds per step of a live teacher, L - C (steady steps: the first of each run warms up).
    cached_step = statistics.median(m["step_seconds"] for m in (metrics_a[1:] or metrics_a))
    live_step = statistics.median(m["step_seconds"] for m in (metrics_live[1:] or metrics_live))
    extra_per_run = (live_step - cached_step) * cfg.steps
    teacher_acc = answer_accuracy(list(iter_rollouts(rollout_shards(p.teacher_answers))), tok)
    report = {
        "config": asdict(cfg),
        "heldout_kl_before": kl0,
        "heldout_kl_after": kl1,
        "kl_reduction": 1 - kl1 / kl0 if kl0 else None,
        "heldout_nll_teacher_answers_before": curve[0]["heldout_nll_teacher_answers"],
        "heldout_nll_teacher_answers_after": curve[-1]["heldout_nll_teacher_answers"],
        "curve": curve,
        "cache": stats,
        "cache_bytes_per_token": stats["bytes_per_scored_token"],
        "teacher_forwards_first_score": first.get("teacher_forwards"),
        "teacher_forwards_second_run": again.get("teacher_forwards"),
        "seconds": {k: round(v, 1) for k, v in times.items()},
        "top1_agreement_before": curve[0]["top1_agreement"],
        "top1_agreement_after": curve[-1]["top1_agreement"],
        "task_accuracy": {
            "teacher": teacher_acc,
            "reported": teacher_acc >= ACCURACY_GATE,
            "note": (f"teacher answers {100 * teacher_acc:.0f} % of the held-out problems (greedy, last number); "
                     + ("students' accuracy is meaningful here" if teacher_acc >= ACCURACY_GATE else
                        f"below {100 * ACCURACY_GATE:.0f} %, so no student accuracy is reported: the teacher cannot "
                        "do the task, and KL / top-1 agreement are the measures of distillation")),
        },
        "break_even": {
            "teacher_pass_seconds": round(times["score_train"], 1),
            "cached_step_seconds": round(cached_step, 3),
            "live_teacher_step_seconds": round(live_step, 3),
            "live_extra_seconds_per_student_run": round(extra_per_run, 1),
            # A rerun finds the cache complete: its score pass did no teacher work, so S was not measured
            "student_runs_to_break_even": (round(times["score_train"] / extra_per_run, 2)
                                           if extra_per_run > 0 and first.get("teacher_forwards") else None),
            "how": f"N* = S / ((L - C) * steps): S the score stage on the training rollouts, L and C a trainer step "
                   f"with a live teacher ({cfg.live_probe_steps}-step probe) and from the cache (student A), "
                   f"{cfg.steps} steps per student run; all measured in this run" + (
                       "" if first.get("teacher_forwards") else " (not here: the training cache was complete before "
                       "this run, so S was not measured; a fresh --out measures it)"),
        },
        "student_b_final_loss": metrics_b[-1]["loss"] if metrics_b else None,
    }
    if report["task_accuracy"]["reported"]:  # greedy answers of the trained student, scored the same way
        student_ans = GenerateConfig(prompts=eval_src, out=str(out / "rollouts" / "eval-student-a"),
                                     student=str(out / "student-a-hf"), n=1, max_tokens=cfg.max_tokens,
                                     temperature=0.0, seed=2, dtype="float32")
        with open_engine(EngineArgs(model=str(out / "student-a-hf"), dtype="float32", max_model_len=1024,
                                    kv_cache_gib=cfg.kv_cache_gib, enforce_eager=cfg.enforce_eager)) as llm:
            run_task(llm, tok, student_ans, 0)
        report["task_accuracy"]["student_a"] = answer_accuracy(
            list(iter_rollouts(rollout_shards(student_ans.out))), tok)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot(report, metrics_a, metrics_b, out / "report.png")
    return report


def plot(report: dict, metrics_a: list[dict], metrics_b: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ax[0].plot([m["step"] for m in metrics_a], [m["loss"] for m in metrics_a], label="student A (seed 1)")
    ax[0].plot([m["step"] for m in metrics_b], [m["loss"] for m in metrics_b], label="student B (seed 2, same cache)")
    ax[0].set(title="training loss (forward KL, tail mode)", xlabel="optimizer step", ylabel="nats / token")
    ax[0].legend()
    c = report["curve"]
    ax[1].plot([p["step"] for p in c], [p["heldout_kl"] for p in c], "o-", label="KL(teacher‖student), held-out")
    ax[1].plot([p["step"] for p in c], [p["heldout_nll_teacher_answers"] for p in c], "s--", label="NLL of teacher answers")
    ax[1].set(title=f"held-out: KL {report['heldout_kl_before']:.2f} → {report['heldout_kl_after']:.2f}, top-1 "
              f"{100 * report['top1_agreement_before']:.0f} → {100 * report['top1_agreement_after']:.0f} %",
              xlabel="optimizer step")
    top1 = ax[1].twinx()
    top1.plot([p["step"] for p in c], [100 * p["top1_agreement"] for p in c], "^:", color="tab:green",
              label="top-1 agreement with the teacher (%)")
    top1.set_ylabel("top-1 agreement %")
    lines = ax[1].get_legend_handles_labels()
    extra = top1.get_legend_handles_labels()
    ax[1].legend(lines[0] + extra[0], lines[1] + extra[1], fontsize=8)
    secs = report["seconds"]
    names = [k for k in ("generate", "teacher", "train_a", "live_probe", "score_again", "train_b") if k in secs]
    ax[2].barh(names, [secs[k] for k in names])
    ax[2].set(title="wall time per stage (s)")
    for i, k in enumerate(names):
        ax[2].text(secs[k], i, f" {secs[k]:.0f}s", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
