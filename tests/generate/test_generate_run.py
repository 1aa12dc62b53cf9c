"""Generate stage on a tiny random Llama with real vLLM: one engine for the module (start-up is the slow part)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.engine import EngineArgs, open_engine
from pipeline.generate.prompts import Prompt, PromptError
from pipeline.generate.sampler import GenerateConfig, check_tokenizer, generate, run_task
from pipeline.store.rollouts import iter_rollouts, rollout_shards
from pipeline.store.shards import read_marker

ROOT = Path(__file__).resolve().parents[2]
# vLLM's log format: "(MainProcess pid=12) INFO 12-01 12:44:54 [model.py:733] ..."
VLLM_INFO = re.compile(r"\bINFO \d\d-\d\d \d\d:\d\d:\d\d \[")


@pytest.fixture(scope="module")
def tok(tiny_student):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_student)


@pytest.fixture(scope="module")
def llm(tiny_student):
    args = EngineArgs(model=str(tiny_student), dtype="float32", enforce_eager=True, kv_cache_gib=0.25,
                      enable_lora=True, max_lora_rank=8)
    with open_engine(args) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"the cat sat on {i} mats"}) + "\n" for i in range(12)))
    return path


def cfg(**kw) -> GenerateConfig:
    base = {"n": 2, "max_tokens": 12, "temperature": 1.0, "seed": 3, "policy_version": 7}
    return load_config(GenerateConfig, None, {**base, **kw})


def user(i: int, text: str = "the dog ran") -> Prompt:
    return Prompt(f"p{i}", [{"role": "user", "content": f"{text} {i}"}], tags={"data_source": "t"})


def ids(result) -> list:
    return [(r["prompt_id"], r["completion_ids"]) for r in result.rows]


def test_same_seed_same_rollouts_and_rows_are_well_formed(llm, tok):
    prompts = [user(i) for i in range(4)]
    a = generate(llm, tok, prompts, cfg(logprobs=True))
    assert ids(a) == ids(generate(llm, tok, prompts, cfg(logprobs=True)))
    assert ids(a) != ids(generate(llm, tok, prompts, cfg(seed=4)))
    # A prompt's samples do not depend on which other prompts share the batch (per-request seeds).
    assert ids(a)[2:4] == ids(generate(llm, tok, prompts[1:2], cfg()))
    assert a.stats["samples"] == 8 and sum(a.stats["finish"].values()) == 8
    for row, text in zip(a.rows, a.texts, strict=True):
        assert (row["source"], row["policy_version"], row["tags"]) == ("student", 7, {"data_source": "t"})
        assert row["finish_reason"] in ("stop", "length")
        assert len(row["completion_logprobs"]) == len(row["completion_ids"]) and max(row["completion_logprobs"]) <= 0
        # One BOS: the template's own, not a second one from re-tokenising or from vLLM.
        assert row["prompt_ids"][0] == tok.bos_token_id and row["prompt_ids"].count(tok.bos_token_id) == 1
        # The ids decode back to vLLM's text (its incremental detokeniser holds back a trailing partial UTF-8 char).
        decoded = tok.decode(row["completion_ids"], skip_special_tokens=True)
        assert decoded.rstrip("\ufffd") == text.rstrip("\ufffd")


def test_schema_round_trip_and_marker(llm, tok, prompts_file, tmp_path):
    c = cfg(prompts=str(prompts_file), out=str(tmp_path), logprobs=True)
    result = run_task(llm, tok, c, 0)
    (shard,) = rollout_shards(tmp_path)
    assert shard.name == "rollouts-00000-of-00001.parquet"
    back = list(iter_rollouts([shard]))
    assert [r["sample_id"] for r in back] == [r["sample_id"] for r in result.rows]
    for r, w in zip(back, result.rows, strict=True):
        assert r["completion_logprobs"] == pytest.approx(w["completion_logprobs"], abs=1e-6)
        assert {k: v for k, v in r.items() if k != "completion_logprobs"} == {
            k: v for k, v in w.items() if k != "completion_logprobs"}
    marker = read_marker(shard)
    assert marker["tokenizer_fingerprint"] == check_tokenizer(tok, c) and marker["policy_version"] == 7


def test_union_of_shard_tasks_equals_unsharded_run(llm, tok, prompts_file, tmp_path):
    whole = run_task(llm, tok, cfg(prompts=str(prompts_file), out=str(tmp_path / "one")), 0)
    parts = tmp_path / "two"
    for i in range(2):
        run_task(llm, tok, cfg(prompts=str(prompts_file), out=str(parts), num_shards=2), i)
    shards = rollout_shards(parts)
    assert [p.name for p in shards] == ["rollouts-00000-of-00002.parquet", "rollouts-00001-of-00002.parquet"]
    union = list(iter_rollouts(shards))
    assert all(len(list(iter_rollouts([p]))) > 0 for p in shards)
    assert sorted(r["sample_id"] for r in union) == sorted(r["sample_id"] for r in whole.rows)


def test_lora_adapter_changes_the_samples(llm, tok, tiny_lora):
    from vllm.lora.request import LoRARequest

    prompts = [user(i) for i in range(3)]
    base = generate(llm, tok, prompts, cfg())
    tuned = generate(llm, tok, prompts, cfg(), lora=LoRARequest("t", 1, str(tiny_lora)))
    assert ids(tuned) != ids(base)
    assert ids(tuned) == ids(generate(llm, tok, prompts, cfg(), lora=LoRARequest("t", 1, str(tiny_lora))))


def test_bad_prompts_refused_or_skipped(llm, tok):
    bad = [user(0), Prompt("empty", [{"role": "user", "content": "  "}]), user(1, "the cat " * 200)]
    with pytest.raises(PromptError, match="'empty' is empty"):
        generate(llm, tok, bad, cfg())
    with pytest.raises(PromptError, match="too long"):
        generate(llm, tok, [bad[2]], cfg())
    r = generate(llm, tok, bad, cfg(on_bad_prompt="skip"))
    assert r.stats["skipped"] == {"empty": 1, "too_long": 1} and r.stats["prompts"] == 1


def test_privileged_teacher_prompt_rides_along_and_does_not_change_the_samples(llm, tok):
    """OPSD: the student samples from its own prompt (same samples as without a teacher prompt); each row carries
    the teacher's prompt ids for the score stage; an empty teacher prompt is refused or skipped."""
    from pipeline.generate.prompts import prompt_ids

    plain = [user(i) for i in range(3)]
    teacher = [{"role": "user", "content": "solution first: the cat sat"}]
    opsd = [Prompt(p.prompt_id, p.messages, tags=p.tags, teacher_messages=teacher) for p in plain]
    a, b = generate(llm, tok, plain, cfg()), generate(llm, tok, opsd, cfg())
    assert ids(a) == ids(b)
    assert all(r["teacher_prompt_ids"] is None for r in a.rows)
    assert all(r["teacher_prompt_ids"] == prompt_ids(tok, teacher) for r in b.rows)
    empty = Prompt("e", plain[0].messages, teacher_messages=[])
    with pytest.raises(PromptError, match="'e' has an empty t field"):
        generate(llm, tok, [empty], cfg(teacher_prompt_field="t"))
    assert generate(llm, tok, [empty, opsd[0]], cfg(on_bad_prompt="skip")).stats["skipped"] == {"empty_teacher_prompt": 1}


def test_tokenizer_mismatch_refused(tok, tmp_path):
    with pytest.raises(ConfigError, match="differs"):
        check_tokenizer(tok, cfg(out=str(tmp_path), expect_tokenizer_fingerprint="0" * 32))


def test_cli_end_to_end_and_rerun_is_a_no_op(tiny_student, prompts_file, tmp_path, capsys):
    """The real `gkd generate` in a fresh process (a second engine in this one would share vLLM's globals). While
    it runs, a second `gkd generate` of the same task and output is refused at once, naming the first."""
    import socket

    import killing

    from pipeline.generate.run import main as generate_main

    cmd = [sys.executable, "-m", "pipeline", "generate", "--prompts", str(prompts_file), "--student",
           str(tiny_student), "--out", str(tmp_path), "--n", "1", "--max-tokens", "4", "--shard", "1",
           "--num-shards", "2", "kv_cache_gib=0.25", "enforce_eager=true", "max_model_len=256"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # it stops itself right after writing its shard, its task lock still held (the lock is released after the marker)
    proc = killing.start(cmd, "rollout-shard:1", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT)
    lock = tmp_path / ".rollouts-00001-of-00002.parquet.lock"
    try:
        killing.wait_stopped(proc)
        assert f'"pid": {proc.pid}' in lock.read_text()
        assert generate_main(cmd[4:]) == 2  # the lock is held from before the engine starts to the shard's marker
    finally:
        killing.resume(proc)
    err = capsys.readouterr().err
    assert f"held by pid {proc.pid} on host {socket.gethostname()}" in err and "gkd generate task 1/2" in err, err
    stdout, stderr = proc.communicate(timeout=1800)
    out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not lock.exists()
    assert "prompts" in out.stdout and "tok/s" in out.stdout and "finish" in out.stdout
    assert (tmp_path / "rollouts-00001-of-00002.parquet.ok").exists()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    # Quiet by default (pipeline/logs.py): none of vLLM's INFO lines, nor its CPU notices; all of them with --verbose.
    assert not VLLM_INFO.search(out.stdout + out.stderr), (out.stdout + out.stderr)[-3000:]
    assert "Transformer Engine" not in out.stderr and "libtcmalloc" not in out.stderr
    loud = subprocess.run([*cmd[:-7], "--shard", "0", *cmd[-5:], "--verbose"], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT, env=env)
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert VLLM_INFO.search(loud.stdout + loud.stderr), "--verbose must show vLLM's INFO lines"
