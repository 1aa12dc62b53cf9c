import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pipeline.store.fingerprint import content_key, sample_id, teacher_fingerprint, tokenizer_fingerprint


def _tok(vocab: dict[str, int]) -> PreTrainedTokenizerFast:
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="</s>")


def test_tokenizer_fingerprint_sees_the_mapping_not_the_size():
    a = _tok({"<unk>": 0, "</s>": 1, "hello": 2, "world": 3})
    b = _tok({"<unk>": 0, "</s>": 1, "hello": 3, "world": 2})  # same size, swapped ids
    c = _tok({"<unk>": 0, "</s>": 1, "hello": 2, "world": 3})
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(c)
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)


def test_tokenizer_fingerprint_sees_special_token_ids():
    a = _tok({"<unk>": 0, "</s>": 1, "x": 2})
    b = PreTrainedTokenizerFast(tokenizer_object=a.backend_tokenizer, unk_token="<unk>", eos_token="x")
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)


def test_teacher_fingerprint_covers_config_and_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"a": 1, "b": 2}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    fp = teacher_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"b": 2, "a": 1}))  # same content, other key order
    assert teacher_fingerprint(tmp_path) == fp
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 99 + b"\1")
    assert teacher_fingerprint(tmp_path) != fp
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weight files"):
        teacher_fingerprint(tmp_path)


def test_content_key_depends_on_every_part():
    ids = np.arange(10)
    base = content_key("T", ids, 4, 64, "raw_logprobs")
    assert base == content_key("T", list(range(10)), 4, 64, "raw_logprobs")
    assert len({base, content_key("U", ids, 4, 64, "raw_logprobs"), content_key("T", ids, 5, 64, "raw_logprobs"),
                content_key("T", ids, 4, 32, "raw_logprobs"), content_key("T", ids, 4, 64, "processed_logprobs"),
                content_key("T", ids[:-1], 4, 64, "raw_logprobs")}) == 6


def test_sample_id_sees_the_prompt_completion_split():
    assert sample_id("p", [1, 2], [3]) != sample_id("p", [1], [2, 3])
    assert sample_id("p", [1, 2], [3]) == sample_id("p", np.array([1, 2]), np.array([3]))


def test_content_key_covers_the_teachers_privileged_prompt():
    ids = np.arange(10)
    plain = content_key("T", ids, 4, 64, "raw_logprobs")
    assert content_key("T", ids, 4, 64, "raw_logprobs", teacher_prompt=None) == plain
    a = content_key("T", ids, 4, 64, "raw_logprobs", teacher_prompt=[7, 8, 9])
    assert a == content_key("T", ids, 4, 64, "raw_logprobs", teacher_prompt=np.array([7, 8, 9]))
    # another privileged view of the same completion, or the student's own prompt as the teacher's: other rows
    assert len({plain, a, content_key("T", ids, 4, 64, "raw_logprobs", teacher_prompt=[7, 8]),
                content_key("T", ids, 4, 64, "raw_logprobs", teacher_prompt=ids[:4])}) == 4


def test_adapter_fingerprint_covers_base_config_and_adapter_weights(tmp_path):
    from pipeline.store.fingerprint import adapter_fingerprint

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    fp = adapter_fingerprint("BASE", tmp_path)
    assert fp != adapter_fingerprint("OTHER", tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 16}))
    assert adapter_fingerprint("BASE", tmp_path) != fp
    fp = adapter_fingerprint("BASE", tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * 63 + b"\1")
    assert adapter_fingerprint("BASE", tmp_path) != fp
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no adapter weight files"):
        adapter_fingerprint("BASE", tmp_path)
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        adapter_fingerprint("BASE", tmp_path / "missing")
