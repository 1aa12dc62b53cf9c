"""Cross-tokenizer distillation from the cache (issue #37): GOLD vs SFT, cache bytes, step time.

    python -m benchmarks.run --only xtok          (~10 min on 2 CPU cores)

The embedded teacher (SmolLM2-135M-Instruct, 49,152 tokens) answers simple prompts (greedy, its own chat template,
vLLM). A student with ANOTHER tokenizer (a byte-level BPE of 1,024 tokens trained here with `tokenizers` on the same
text; a random 2-layer Llama) gets the answers as rollouts in its tokens (its own template), scored by the teacher
with `gkd score cross_tokenizer=true` (the same engine). Then, same seed, steps and data order:

- KD: `loss=gold gold_matched_weight=1 gold_unmatched_weight=1 sft_alpha=1` (GOLD over the aligned spans, both
  parts at full weight, GKD's SFT mix);
- SFT: `loss=gold gold_matched_weight=0 gold_unmatched_weight=0 sft_alpha=1` (the KD term weighted 0: CE only);

both exported and judged by the NLL per token of held-out teacher answers (student tokens, a transformers
forward). Bytes: the cross-tokenizer cache against a same-tokenizer cache of the same texts in the teacher's ids,
per teacher token. Step time: the same student trained with `loss=gkd` from a same-tokenizer cache of its own
rollouts (scored by the student's own weights as a teacher, the only teacher with its tokenizer here) against
`loss=gold`, both fused, median step seconds after the first.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pipeline.assets import teacher_dir
from pipeline.engine import EngineArgs, open_engine
from pipeline.score.scorer import ScoreConfig, score
from pipeline.store import TeacherCache
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import rollout_row, write_rollouts

K = 32
STEPS = 60
LR = 2e-3
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


def build_student(out: Path, texts: list[str], vocab: int = 1024) -> Path:
    """A byte-level BPE trained on the texts (chat specials, our template) and a random Llama over it."""
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
    torch.manual_seed(0)
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


def _train(student: Path, cache: Path, save: Path, **kw) -> list[dict]:
    args = dict(student=str(student), cache=f"[{cache}]", micro_batch_size=8, global_batch_size=8, seq_length=128,
                train_steps=STEPS, lr=LR, min_lr=LR / 10, warmup_steps=2, save_interval=STEPS, save_dir=str(save),
                progress=False, seed=1, **kw)
    subprocess.run([sys.executable, "-m", "pipeline", "train", *[f"{k}={v}" for k, v in args.items()]], check=True,
                   stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def _heldout_nll(save: Path, out: Path, rows: list[dict]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.train.checkpoint import step_dir

    subprocess.run([sys.executable, "-m", "pipeline", "export", "--checkpoint", str(step_dir(save, STEPS)),
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    nll = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            logp = torch.log_softmax(model(ids).logits[0], -1)
            pos = torch.arange(len(r["prompt_ids"]) - 1, ids.shape[1] - 1)
            nll.append(-logp[pos, ids[0, pos + 1]])
    return float(torch.cat(nll).mean())


def run(work: Path) -> dict:
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
        student = build_student(work / "student", [*qs, *answers])
        s_tok = AutoTokenizer.from_pretrained(student)
        rows = _rollouts(s_tok, list(zip(qs, answers, strict=True)))
        held, train = rows[::5], [r for i, r in enumerate(rows) if i % 5]
        write_rollouts(work / "r-student" / "r-00000-of-00001.parquet", train,
                       tokenizer_fingerprint=tokenizer_fingerprint(s_tok))
        write_rollouts(work / "r-teacher" / "r-00000-of-00001.parquet", _as_teacher_ids(train, s_tok, t_tok),
                       tokenizer_fingerprint=tokenizer_fingerprint(t_tok))
        common = dict(teacher=str(teacher), topk=K, max_model_len=512, batch_tokens=4096)
        cross = score(ScoreConfig(rollouts=str(work / "r-student"), cache=str(work / "c-cross"), cross_tokenizer=True,
                                  student_tokenizer=str(student), **common), llm=llm)
        score(ScoreConfig(rollouts=str(work / "r-teacher"), cache=str(work / "c-same"), **common), llm=llm)
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
        teacher_vocab=len(t_tok),
        cross_bytes=c_stats["bytes"], same_bytes=s_stats["bytes"], teacher_tokens=c_stats["scored_tokens"],
        cross_bytes_per_token=c_stats["bytes_per_scored_token"], same_bytes_per_token=s_stats["bytes_per_scored_token"])
    res["bytes_ratio"] = res["cross_bytes_per_token"] / res["same_bytes_per_token"]
    runs = {
        # the matched-token JSD at full weight (TRL's adaptive weight would be shared/teacher vocab, ~2 % here)
        "gold": dict(loss="gold", gold_matched_weight=1.0, gold_unmatched_weight=1.0, sft_alpha=1.0),
        "sft": dict(loss="gold", gold_matched_weight=0.0, gold_unmatched_weight=0.0, sft_alpha=1.0),
        "gkd": dict(loss="gkd", sft_alpha=1.0),
    }
    res["runs"] = {}
    for name, kw in runs.items():
        cache = work / ("c-self" if name == "gkd" else "c-cross")
        t = time.perf_counter()
        metrics = _train(student, cache, work / f"run-{name}", **kw)
        entry = {"train_seconds": round(time.perf_counter() - t, 1),
                 "median_step_s": statistics.median(m["step_seconds"] for m in metrics[1:]),
                 "last_loss": metrics[-1]["loss"]}
        if name != "gkd":
            entry["heldout_nll"] = _heldout_nll(work / f"run-{name}", work / f"hf-{name}", held)
        res["runs"][name] = entry
    res["nll_ratio"] = res["runs"]["gold"]["heldout_nll"] / res["runs"]["sft"]["heldout_nll"]
    res["step_ratio"] = res["runs"]["gold"]["median_step_s"] / res["runs"]["gkd"]["median_step_s"]
    return res


def markdown(r: dict) -> str:
    g, s, k = r["runs"]["gold"], r["runs"]["sft"], r["runs"]["gkd"]
    a = r["alignment"]
    return "\n".join([
        f"SmolLM2-135M-Instruct's greedy answers to {r['prompts']} prompts ({r['train_samples']} training, "
        f"{r['heldout_samples']} held out) distilled into a random 2-layer Llama with a {r['student_vocab']}-token "
        f"BPE of its own ({r['matched_ids']} token strings shared with the teacher's {r['teacher_vocab']}), from a "
        f"k={r['k']} cross-tokenizer cache; {r['steps']} steps, lr {r['lr']}, 8 samples per step, same seed and "
        f"order for every run. Alignment: {100 * a['one_to_one_share']:.1f} % of student tokens in 1:1 spans, "
        f"{a['mean_span_student_tokens']:.2f} student / {a['mean_span_teacher_tokens']:.2f} teacher tokens per span; "
        f"{r['mismatched']} rollout(s) did not round-trip.",
        "",
        "| row | result | measured | baseline | goal |",
        "|---|---|---|---|---|",
        f"| cross-tokenizer KD vs SFT held-out NLL | **{r['nll_ratio']:.3f}×** | loss=gold (weights 1/1) sft_alpha=1: "
        f"{g['heldout_nll']:.4f} nats/token | SFT on the teacher's answers: {s['heldout_nll']:.4f} | ≤ 0.95× |",
        f"| cross-tokenizer cache bytes/token vs same-tokenizer | **{r['bytes_ratio']:.3f}×** | "
        f"{r['cross_bytes_per_token']:.1f} B per teacher token (spans included) | same texts, same teacher, "
        f"same-tokenizer cache: {r['same_bytes_per_token']:.1f} | report |",
        f"| gold vs gkd step time | **{r['step_ratio']:.2f}×** | loss=gold: {g['median_step_s']:.3f} s | "
        f"loss=gkd (same student, fused): {k['median_step_s']:.3f} s | report |",
    ])
