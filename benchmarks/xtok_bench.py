"""Cross-tokenizer distillation from the cache (issue #37): GOLD vs SFT, cache bytes, step time.

    python -m benchmarks.run --only xtok          (~20 min on 2 CPU cores)

The embedded teacher (SmolLM2-135M-Instruct, 49,152 tokens) answers simple prompts (greedy, its own chat template,
vLLM). Two students with ANOTHER tokenizer (byte-level BPEs trained here with `tokenizers` on the same texts: as
many merges as the texts support, ~1.9k tokens, and a finer 1,024; random 2-layer Llamas) get the answers as
rollouts in their tokens (their own template), scored by the teacher with `gkd score cross_tokenizer=true` (the
same engine). Then, per student, same seed, steps, lr and data order:

- KD: `loss=gold gold_matched_weight=1 gold_unmatched_weight=1 sft_alpha=1` (GOLD over the aligned spans, both
  parts at full weight, GKD's SFT mix) at gold's default β (0: forward KL on the matched ids, `TrainConfig.kd_beta`),
  and the same at β 0.5 (the JSD, GKD's default) beside it;
- SFT: `loss=gold gold_matched_weight=0 gold_unmatched_weight=0 sft_alpha=1` (the KD term weighted 0: CE only);

judged by the NLL per token of held-out teacher answers (student tokens, a transformers forward of the export) at
several checkpoints: the headline compares each run's best (early stopping, what a practitioner keeps), a second
row the last step (SFT has memorised the 112 samples by then). Bytes: the cross-tokenizer cache against a
same-tokenizer cache of the same texts in the teacher's ids, per teacher token. Step time: the coarse student
trained with `loss=gkd` from a same-tokenizer cache of its own rollouts (scored by the student's own weights as a
teacher, the only teacher with its tokenizer here) against `loss=gold`, both fused, median step seconds after the
first, one intra-op thread each (`_train`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pipeline.assets import teacher_dir
from pipeline.engine import EngineArgs, open_engine
from pipeline.score.config import ScoreConfig
from pipeline.score.scorer import score
from pipeline.store import TeacherCache
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import rollout_row, write_rollouts

K = 32
STEPS = 200
EVERY = 25
EVALS = (25, 50, 75, 100, 150, 200)  # held-out NLL at these checkpoints of both runs
LR = 2e-3
# The split and seeds of this run. β 0 became gold's default after trial runs on held-out samples rows[0::5], student
# init seed 0 and data-order seed 1; it is confirmed here on samples and seeds not used to pick it.
HELD_OFFSET, INIT_SEED, DATA_SEED = 2, 1, 2
COARSE, FINE = 4096, 1024  # BPE sizes asked for; the texts support ~1.9k merges, so the coarse one stops there
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOPICS = ["the sea", "a cat", "the moon", "a library", "rain", "a train", "music", "a garden", "winter", "bread",
          "a river", "the wind", "a clock", "mountains", "a letter", "coffee", "the stars", "a bridge", "autumn",
          "a market"]


def prompts() -> list[str]:
    out = [f"What is {a} plus {b}? Answer in one sentence." for a in range(2, 12) for b in (3, 7)]
    out += [f"Write one short sentence about {t}." for t in TOPICS]
    out += [f"Give two facts about {t}." for t in TOPICS]
    out += [f"What is {a} minus {b}? Answer in one sentence." for a in range(12, 22) for b in (2, 5)]
    out += [f"Why is {t} important? One sentence." for t in TOPICS]
    out += [f"Describe {t} to a child." for t in TOPICS]
    out += [f"What is {a} times {b}? Answer in one sentence." for a in range(2, 12) for b in (2, 3)]
    return out


def build_student(out: Path, texts: list[str], vocab: int) -> Path:
    """A byte-level BPE of at most `vocab` tokens trained on the texts (chat specials, our template) and a random
    Llama over it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(INIT_SEED)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def _rollouts(tok, pairs: list[tuple[str, str]], template: bool = True) -> list[dict]:
    rows = []
    for i, (q, a) in enumerate(pairs):
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        rows.append(rollout_row(prompt_id=f"q{i}", prompt_ids=tok(text, add_special_tokens=False).input_ids,
                                completion_ids=tok(a + "<|im_end|>", add_special_tokens=False).input_ids,
                                source="dataset"))
    return rows


def _as_teacher_ids(student_rows: list[dict], student_tok, teacher_tok) -> list[dict]:
    """The same texts in the teacher's ids (what the cross-tokenizer scorer feeds the engine)."""
    from pipeline.store.align import decode

    return [rollout_row(prompt_id=r["prompt_id"], source="dataset",
                        prompt_ids=teacher_tok(decode(student_tok, r["prompt_ids"]), add_special_tokens=False).input_ids,
                        completion_ids=teacher_tok(decode(student_tok, r["completion_ids"]),
                                                   add_special_tokens=False).input_ids) for r in student_rows]


def _train(student: Path, cache: Path, save: Path, save_interval: int = STEPS, **kw) -> list[dict]:
    """`gkd train` in a subprocess with one intra-op thread: on a shared 2-core VM torch's default two threads spin
    against the other load, and a step of many small kernels (GOLD) slows 10-100x with the load average (measured:
    span_divergence 30 ms at one thread, 0.3-3.6 s at two, same inputs); one thread times the work itself."""
    args = dict(student=str(student), cache=f"[{cache}]", micro_batch_size=8, global_batch_size=8, seq_length=128,
                train_steps=STEPS, lr=LR, min_lr=LR / 10, warmup_steps=2, save_interval=save_interval,
                save_dir=str(save), progress=False, seed=DATA_SEED, **kw)
    subprocess.run([sys.executable, "-m", "pipeline", "train", *[f"{k}={v}" for k, v in args.items()]], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def _nll(save: Path, step: int, out: Path, rows: list[dict]) -> float:
    """NLL per token of the rows' completions (student tokens) under the run's checkpoint at `step`, exported and run
    by transformers (independent of the trainer)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.train.checkpoint import step_dir

    subprocess.run([sys.executable, "-m", "pipeline", "export", "--checkpoint", str(step_dir(save, step)),
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    nll = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            logp = torch.log_softmax(model(ids).logits[0], -1)
            pos = torch.arange(len(r["prompt_ids"]) - 1, ids.shape[1] - 1)
            nll.append(-logp[pos, ids[0, pos + 1]])
    shutil.rmtree(out)
    return float(torch.cat(nll).mean())


def prepare(work: Path) -> dict:
    """The teacher's answers, the student, the three caches (cross, same-tokenizer, the student's own) in `work`."""
    from transformers import AutoTokenizer

    from pipeline.store.align import vocab_map

    work.mkdir(parents=True, exist_ok=True)
    teacher = teacher_dir()
    t_tok = AutoTokenizer.from_pretrained(teacher)
    qs = prompts()
    t0 = time.perf_counter()
    args = EngineArgs(model=str(teacher), dtype="float32", max_model_len=513, kv_cache_gib=0.5, enforce_eager=True,
                      max_num_batched_tokens=4096)
    res: dict = {"k": K, "steps": STEPS, "lr": LR, "prompts": len(qs)}
    with open_engine(args, max_logprobs=K, logprobs_mode="raw_logprobs") as llm:
        from vllm import SamplingParams

        chats = [t_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in qs]
        outs = llm.generate(chats, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
        answers = [o.outputs[0].text.strip() or "I do not know." for o in outs]
        res["generate_seconds"] = round(time.perf_counter() - t0, 1)
        res["pairs"] = list(zip(qs, answers, strict=True))
        student = build_student(work / "student", [*qs, *answers], COARSE)
        fine = build_student(work / "student-fine", [*qs, *answers], FINE)
        s_tok = AutoTokenizer.from_pretrained(student)
        rows = _rollouts(s_tok, list(zip(qs, answers, strict=True)))
        held, train = rows[HELD_OFFSET::5], [r for i, r in enumerate(rows) if i % 5 != HELD_OFFSET]
        write_rollouts(work / "r-student" / "r-00000-of-00001.parquet", train,
                       tokenizer_fingerprint=tokenizer_fingerprint(s_tok))
        write_rollouts(work / "r-teacher" / "r-00000-of-00001.parquet", _as_teacher_ids(train, s_tok, t_tok),
                       tokenizer_fingerprint=tokenizer_fingerprint(t_tok))
        common = dict(teacher=str(teacher), topk=K, max_model_len=512, batch_tokens=4096)
        cross = score(ScoreConfig(rollouts=str(work / "r-student"), cache=str(work / "c-cross"), cross_tokenizer=True,
                                  student_tokenizer=str(student), **common), llm=llm)
        score(ScoreConfig(rollouts=str(work / "r-teacher"), cache=str(work / "c-same"), **common), llm=llm)
        f_tok = AutoTokenizer.from_pretrained(fine)
        f_rows = [r for i, r in enumerate(_rollouts(f_tok, res["pairs"])) if i % 5 != HELD_OFFSET]
        write_rollouts(work / "r-fine" / "r-00000-of-00001.parquet", f_rows,
                       tokenizer_fingerprint=tokenizer_fingerprint(f_tok))
        score(ScoreConfig(rollouts=str(work / "r-fine"), cache=str(work / "c-cross-fine"), cross_tokenizer=True,
                          student_tokenizer=str(fine), **common), llm=llm)
    # the student's own weights as a teacher of its tokenizer: a same-tokenizer cache for the gkd step time
    s_args = EngineArgs(model=str(student), dtype="float32", max_model_len=513, kv_cache_gib=0.1, enforce_eager=True,
                        max_num_batched_tokens=4096)
    with open_engine(s_args, max_logprobs=K, logprobs_mode="raw_logprobs") as llm:
        score(ScoreConfig(rollouts=str(work / "r-student"), cache=str(work / "c-self"), teacher=str(student), topk=K,
                          max_model_len=512, batch_tokens=4096), llm=llm)
    c_stats, s_stats = TeacherCache.open(work / "c-cross").stats(), TeacherCache.open(work / "c-same").stats()
    vmap = vocab_map(s_tok, t_tok, len(t_tok))
    res.update(
        mismatched=len(cross.get("mismatched", [])), train_samples=len(train), heldout_samples=len(held),
        alignment=c_stats["alignment"], matched_ids=int((vmap >= 0).sum()), student_vocab=len(s_tok),
        fine_alignment=TeacherCache.open(work / "c-cross-fine").stats()["alignment"], fine_vocab=len(f_tok),
        teacher_vocab=len(t_tok),
        cross_bytes=c_stats["bytes"], same_bytes=s_stats["bytes"], teacher_tokens=c_stats["scored_tokens"],
        cross_bytes_per_token=c_stats["bytes_per_scored_token"], same_bytes_per_token=s_stats["bytes_per_scored_token"])
    res["bytes_ratio"] = res["cross_bytes_per_token"] / res["same_bytes_per_token"]
    return res


def run(work: Path) -> dict:
    from transformers import AutoTokenizer

    res = prepare(work)
    pairs = res.pop("pairs")
    res.update(steps=STEPS, evals=list(EVALS), held_offset=HELD_OFFSET, init_seed=INIT_SEED, data_seed=DATA_SEED)
    kd = dict(loss="gold", gold_matched_weight=1.0, gold_unmatched_weight=1.0, sft_alpha=1.0)
    sft = dict(loss="gold", gold_matched_weight=0.0, gold_unmatched_weight=0.0, sft_alpha=1.0)
    runs = {  # name: (student, cache, keywords); the matched JSD at full weight (TRL's adaptive one: ~3 % here)
        "gold": ("student", "c-cross", kd), "sft": ("student", "c-cross", sft),  # gold: its default β (0)
        "gold-b05": ("student", "c-cross", {**kd, "beta": 0.5}),  # the JSD, the default before this split
        "gold-fine": ("student-fine", "c-cross-fine", kd), "sft-fine": ("student-fine", "c-cross-fine", sft),
        "gkd": ("student", "c-self", dict(loss="gkd", sft_alpha=1.0)),
    }
    res["runs"] = {}
    for name, (student, cache, kw) in runs.items():
        held = _rollouts(AutoTokenizer.from_pretrained(work / student), pairs)[HELD_OFFSET::5]
        t = time.perf_counter()
        metrics = _train(work / student, work / cache, work / f"run-{name}", save_interval=EVERY, **kw)
        entry = {"train_seconds": round(time.perf_counter() - t, 1),
                 "median_step_s": statistics.median(m["step_seconds"] for m in metrics[1:]),
                 "last_loss": metrics[-1]["loss"],
                 "curve": {m["step"]: [round(m["jsd"], 4), round(m["sft"], 4)] for m in metrics
                           if m["step"] in EVALS or m["step"] == 1}}
        if name != "gkd":
            entry["heldout_nll"] = {s: _nll(work / f"run-{name}", s, work / f"hf-{name}", held) for s in EVALS}
        res["runs"][name] = entry
    for tag in ("", "-fine"):
        g, b = res["runs"]["gold" + tag]["heldout_nll"], res["runs"]["sft" + tag]["heldout_nll"]
        res["best" + tag] = {"gold": min(g.items(), key=lambda x: x[1]), "sft": min(b.items(), key=lambda x: x[1])}
        res["nll_ratio" + tag] = res["best" + tag]["gold"][1] / res["best" + tag]["sft"][1]
        res["last_ratio" + tag] = g[STEPS] / b[STEPS]
    b05 = res["runs"]["gold-b05"]["heldout_nll"]
    res["best-b05"] = min(b05.items(), key=lambda x: x[1])
    res["nll_ratio-b05"] = res["best-b05"][1] / res["best"]["sft"][1]
    res["step_ratio"] = res["runs"]["gold"]["median_step_s"] / res["runs"]["gkd"]["median_step_s"]
    return res


def _curve(nll: dict) -> str:
    return ", ".join(f"{s}: {v:.2f}" for s, v in nll.items())


def markdown(r: dict) -> str:
    runs = r["runs"]
    g, s, k = runs["gold"], runs["sft"], runs["gkd"]
    a, fa = r["alignment"], r["fine_alignment"]
    bg, bs = r["best"]["gold"], r["best"]["sft"]
    fg, fs = r["best-fine"]["gold"], r["best-fine"]["sft"]
    last = r["steps"]
    return "\n".join([
        f"SmolLM2-135M-Instruct's greedy answers to {r['prompts']} prompts ({r['train_samples']} training, "
        f"{r['heldout_samples']} held out) distilled into a random 2-layer Llama with a byte-level BPE of its own, "
        f"trained on the same texts: {r['student_vocab']} tokens (asked for {COARSE}; the texts support no more "
        f"merges), {r['matched_ids']} token strings shared with the teacher's {r['teacher_vocab']}, "
        f"{100 * a['one_to_one_share']:.1f} % of student tokens in 1:1 spans, {a['mean_span_student_tokens']:.2f} "
        f"student / {a['mean_span_teacher_tokens']:.2f} teacher tokens per span, from a k={r['k']} cross-tokenizer "
        f"cache; {r['mismatched']} rollout(s) did not round-trip. KD: `loss=gold gold_matched_weight=1 "
        f"gold_unmatched_weight=1 sft_alpha=1` at gold's default β 0 (`beta: null`, `TrainConfig.kd_beta`: forward KL "
        f"on the matched ids), and the same at β 0.5; SFT: the same with both GOLD weights 0 (CE on the teacher's "
        f"answers only). All runs: {last} steps of 8 samples (~{last * 8 // r['train_samples']} epochs), lr "
        f"{r['lr']} (cosine to a tenth, 2 warm-up steps), data-order seed {r['data_seed']}, the same data order; "
        "held-out NLL per student token at steps " + ", ".join(map(str, r["evals"])) + " of each (a transformers "
        "forward of the export). Held out: every fifth sample from index "
        f"{r['held_offset']}; students initialised with seed {r['init_seed']}. β 0 was picked as gold's default "
        "after trial runs on another split (every fifth from index 0, init seed 0, data-order seed 1: 0.912× there "
        "against 0.997× at β 0.5, BENCHMARKS.md of 2026-12-03 17:58 UTC), so this split and these seeds were not "
        "used to pick it.",
        "",
        "Why this regime: 112 samples are few, so the student first learns (held-out NLL falls from ln V) and then "
        "memorises them (SFT's training CE reaches ~0, held-out NLL climbs back); 60 steps, the earlier setting, "
        "stopped on the way down, where both runs are the same model up to noise. A practitioner keeps each run's "
        "best checkpoint (early stopping), so the headline compares each run's best held-out NLL on the same grid; "
        f"the second row compares the last step ({last}), where SFT has overfitted and KD's soft targets act as a "
        "regulariser. The third row repeats the comparison for a student with a finer BPE "
        f"({r['fine_vocab']} tokens, {100 * fa['one_to_one_share']:.1f} % of student tokens in 1:1 spans, "
        f"{fa['mean_span_student_tokens']:.2f} student tokens per span): where a teacher token is split into several "
        "student tokens, GOLD's matched JSD finds the teacher's probability of the student's first piece (~0) and its "
        "merged student vector is scaled by the pieces' probabilities, so the KD term at β 0.5 pulls the student "
        "away from the text there (TRL's definition, which ours equals); KD without SFT on that student lowers its NLL at "
        "single-token spans but raises it at split ones above a uniform model's (trial runs, issue #37). "
        "Why β 0 for gold: forward KL on the matched ids, t·(log t − log s), has no term for the student's own mass "
        "that the JSD's (1 − β)·s·log(s/m) adds, the term that pays the student to shrink mass the teacher does not "
        "share (here: its own text at split spans); on fixed teacher answers it is also the classical offline "
        "distillation objective. GKD's default stays 0.5. "
        "Held-out NLL along the runs (step: nats/token): KD (β 0) " + _curve(g["heldout_nll"]) + "; SFT "
        + _curve(s["heldout_nll"]) + "; KD at β 0.5 " + _curve(runs["gold-b05"]["heldout_nll"]) + ".",
        "",
        "Step time: both runs with one intra-op thread (`OMP_NUM_THREADS=1`): on this shared VM two threads spin "
        "against the other load and the many small kernels of a GOLD step slowed 10-100x with the load average "
        "(the earlier 31x), which measured the machine, not the loss.",
        "",
        "| row | result | measured | baseline | goal |",
        "|---|---|---|---|---|",
        f"| cross-tokenizer KD vs SFT held-out NLL | **{r['nll_ratio']:.3f}×** | loss=gold (weights 1/1, default β 0) "
        f"sft_alpha=1, best checkpoint (step {bg[0]}): {bg[1]:.4f} nats/token | SFT on the teacher's answers, best "
        f"(step {bs[0]}): {bs[1]:.4f} | ≤ 0.95× |",
        f"| cross-tokenizer KD vs SFT held-out NLL, last step ({last}, SFT overfitted) | **{r['last_ratio']:.3f}×** | "
        f"{g['heldout_nll'][last]:.4f} | {s['heldout_nll'][last]:.4f} | report |",
        f"| cross-tokenizer KD (β 0.5: the JSD, GKD's default) vs SFT held-out NLL | "
        f"**{r['nll_ratio-b05']:.3f}×** | best (step {r['best-b05'][0]}): {r['best-b05'][1]:.4f}; last step "
        f"{runs['gold-b05']['heldout_nll'][last]:.4f} | SFT best (step {bs[0]}): {bs[1]:.4f} | report |",
        f"| cross-tokenizer KD vs SFT held-out NLL, {r['fine_vocab']}-token student | **{r['nll_ratio-fine']:.3f}×** | "
        f"best (step {fg[0]}): {fg[1]:.4f}; last step {r['last_ratio-fine']:.3f}× | best (step {fs[0]}): "
        f"{fs[1]:.4f} | report |",
        f"| cross-tokenizer cache bytes/token vs same-tokenizer | **{r['bytes_ratio']:.3f}×** | "
        f"{r['cross_bytes_per_token']:.1f} B per teacher token (spans included) | same texts, same teacher, "
        f"same-tokenizer cache: {r['same_bytes_per_token']:.1f} | report |",
        f"| gold vs gkd step time | **{r['step_ratio']:.2f}×** | loss=gold: {g['median_step_s']:.3f} s | "
        f"loss=gkd (same student, fused): {k['median_step_s']:.3f} s | report |",
    ])
