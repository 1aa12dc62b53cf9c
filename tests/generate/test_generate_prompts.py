"""Prompt sources, the chat template applied once, and `gkd import` (no vLLM needed)."""

from __future__ import annotations

import json

import pytest

from pipeline.generate import import_run
from pipeline.generate.prompts import PromptError, load_prompts, prompt_ids, response_ids
from pipeline.store.rollouts import iter_rollouts, rollout_shards
from pipeline.store.schema import load_schema
from pipeline.store.shards import read_marker


@pytest.fixture(scope="module")
def tok(tiny_student):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_student)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_missing_field_names_the_field_and_the_file(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"question": "the cat"}])
    with pytest.raises(PromptError, match=r"p\.jsonl.*'prompt'"):
        load_prompts(str(src))
    with pytest.raises(PromptError, match=r"p\.jsonl.*'conv'"):
        load_prompts(str(src), messages_field="conv")
    assert load_prompts(str(src), prompt_field="question")[0].messages == [{"role": "user", "content": "the cat"}]


def test_parquet_save_to_disk_and_messages(tmp_path):
    import datasets

    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2"},
            {"role": "assistant", "content": "4"}]
    ds = datasets.Dataset.from_list([{"id": "a", "conv": conv}, {"id": "b", "conv": conv[:2]}])
    ds.to_parquet(tmp_path / "c.parquet")
    ds.save_to_disk(tmp_path / "saved")
    for src in (tmp_path / "c.parquet", tmp_path / "saved"):
        a, b = load_prompts(str(src), messages_field="conv", id_field="id")
        assert (a.prompt_id, a.messages, a.response) == ("a", conv[:2], "4")  # final assistant turn = response
        assert (b.prompt_id, b.response) == ("b", None)


def test_reasoning_gym_is_deterministic_and_keeps_answers():
    a = load_prompts("reasoning-gym:basic_arithmetic,chain_sum?size=3&seed=5")
    b = load_prompts("reasoning-gym:basic_arithmetic,chain_sum?size=3&seed=5")
    assert a == b and len(a) == 6 and len({p.prompt_id for p in a}) == 6
    assert a[0].response == a[0].tags["answer"] and a[0].messages[0]["role"] == "user"
    assert a != load_prompts("reasoning-gym:basic_arithmetic,chain_sum?size=3&seed=6")
    with pytest.raises(PromptError, match="unknown"):
        load_prompts("reasoning-gym:basic_arithmetic?sise=3")


def test_chat_template_applied_once(tok):
    msgs = [{"role": "user", "content": "the cat sat"}]
    ids = prompt_ids(tok, msgs)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    # The trap this avoids: the template already renders BOS and the tokenizer adds another.
    naive = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)).input_ids
    assert naive[:2] == [tok.bos_token_id] * 2


def test_response_ids_are_the_template_suffix_ending_at_eos(tok):
    msgs = [{"role": "user", "content": "one plus two"}]
    p = prompt_ids(tok, msgs)
    c = response_ids(tok, msgs, "three", p)
    full = tok.apply_chat_template([*msgs, {"role": "assistant", "content": "three"}], return_dict=False)
    assert full[: len(p) + len(c)] == p + c and c[-1] == tok.eos_token_id
    assert tok.decode(c, skip_special_tokens=True) == "three"


def test_import_path(tmp_path, tiny_student, tok, capsys):
    rows = [{"prompt": f"the cat {i}", "response": f"sat {i}"} for i in range(6)] + [{"prompt": "", "response": "x"}]
    src = write_jsonl(tmp_path / "sft.jsonl", rows)
    out = tmp_path / "out"
    base = ["--dataset", str(src), "--tokenizer", str(tiny_student), "--out", str(out)]
    assert import_run.main(base) == 2 and "empty prompt" in capsys.readouterr().err
    assert import_run.main([*base, "--on-bad", "skip"]) == 0
    (shard,) = rollout_shards(out)
    got = list(iter_rollouts([shard]))
    assert len(got) == 6 and read_marker(shard)["skipped"] == {"empty_prompt": 1}
    r = got[0]
    assert set(r) == set(load_schema("rollout").names)
    assert (r["source"], r["policy_version"], r["finish_reason"], r["completion_logprobs"]) == ("dataset", None, None, None)
    assert r["prompt_ids"] == prompt_ids(tok, [{"role": "user", "content": "the cat 0"}])
    assert tok.decode(r["completion_ids"], skip_special_tokens=True) == "sat 0"
    assert import_run.main([*base, "--on-bad", "skip"]) == 0 and "nothing to do" in capsys.readouterr().out

    # Two shard tasks hold exactly the rows of the unsharded run.
    for i in range(2):
        assert import_run.main([*base, "--on-bad", "skip", "--out", str(tmp_path / "sh"), "--shard", str(i),
                              "--num-shards", "2"]) == 0
    union = list(iter_rollouts(rollout_shards(tmp_path / "sh")))
    assert sorted(x["sample_id"] for x in union) == sorted(x["sample_id"] for x in got)


def test_import_reasoning_gym_and_tokenizer_mismatch(tmp_path, tiny_student, capsys):
    out = tmp_path / "rg"
    args = ["--dataset", "reasoning-gym:basic_arithmetic?size=4&seed=0", "--tokenizer", str(tiny_student)]
    assert import_run.main([*args, "--out", str(out)]) == 0
    assert len(list(iter_rollouts(rollout_shards(out)))) == 4
    marker = out / "dataset-00000-of-00001.parquet.ok"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "tokenizer_fingerprint": "0" * 32}))
    assert import_run.main([*args, "--out", str(out), "--shard", "0", "--num-shards", "2"]) == 2
    assert "differs" in capsys.readouterr().err


def test_import_with_a_privileged_teacher_prompt(tmp_path, tiny_student, tok, capsys):
    """--teacher-prompt-field: a text field becomes one user message, a chat field its turns, each through the chat
    template; the student's prompt and completion are unchanged; an empty field is refused or skipped."""
    rows = [{"q": "the cat 1", "a": "sat 1", "t": "the cat 1 solution: sat 1"},
            {"q": "the dog 2", "a": "ran 2", "t": "the dog 2 solution: ran 2"},
            {"q": "the mat 3", "a": "red 3", "t": " "}]
    src = write_jsonl(tmp_path / "opsd.jsonl", rows)
    base = ["--dataset", str(src), "--tokenizer", str(tiny_student), "--prompt-field", "q", "--response-field", "a",
            "--teacher-prompt-field", "t"]
    assert import_run.main([*base, "--out", str(tmp_path / "x")]) == 2
    assert "row '2': empty teacher prompt" in capsys.readouterr().err
    assert import_run.main([*base, "--out", str(tmp_path / "o"), "--on-bad", "skip"]) == 0
    (shard,) = rollout_shards(tmp_path / "o")
    got = {r["prompt_id"]: r for r in iter_rollouts([shard])}
    assert set(got) == {"0", "1"} and read_marker(shard)["skipped"] == {"empty_teacher_prompt": 1}
    assert got["0"]["teacher_prompt_ids"] == prompt_ids(tok, [{"role": "user", "content": rows[0]["t"]}])
    chat = [{"role": "system", "content": "ref: ran 2"}, {"role": "user", "content": "the dog 2"}]
    src_chat = write_jsonl(tmp_path / "chat.jsonl", [{"q": "the dog 2", "t": chat}])
    (p,) = load_prompts(str(src_chat), prompt_field="q", teacher_prompt_field="t")
    assert p.teacher_messages == chat and p.messages == [{"role": "user", "content": "the dog 2"}]
    plain = import_run.main(["--dataset", str(src), "--tokenizer", str(tiny_student), "--prompt-field", "q",
                           "--response-field", "a", "--out", str(tmp_path / "p")])
    assert plain == 0
    for r in iter_rollouts(rollout_shards(tmp_path / "p")):
        assert r["teacher_prompt_ids"] is None
        if r["prompt_id"] in got:  # the student's view does not change
            assert (r["prompt_ids"], r["completion_ids"]) == (got[r["prompt_id"]]["prompt_ids"],
                                                              got[r["prompt_id"]]["completion_ids"])
    with pytest.raises(PromptError, match="no field 'nope'"):
        load_prompts(str(src), prompt_field="q", teacher_prompt_field="nope")
    with pytest.raises(PromptError, match="teacher_prompt_field / tag_fields need a dataset file"):
        load_prompts("reasoning-gym:basic_arithmetic?size=2&seed=0", teacher_prompt_field="t")


def test_import_tag_fields_become_rollout_tags(tmp_path, tiny_student):
    src = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "the cat 1", "response": "sat", "task": "math", "n": 3},
                                                 {"prompt": "the dog 2", "response": "ran", "task": "code", "n": None}])
    out = tmp_path / "o"
    assert import_run.main(["--dataset", str(src), "--tokenizer", str(tiny_student), "--out", str(out),
                          "--tag-field", "task", "--tag-field", "n"]) == 0
    tags = sorted((r["tags"] for r in iter_rollouts(rollout_shards(out))), key=lambda t: t["task"])
    assert tags == [{"data_source": "mixed.jsonl", "task": "code", "n": ""},
                    {"data_source": "mixed.jsonl", "task": "math", "n": "3"}]
    with pytest.raises(PromptError, match="no field 'nope'"):
        load_prompts(str(src), tag_fields=["nope"])
