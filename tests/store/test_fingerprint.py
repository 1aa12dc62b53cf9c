import hashlib
import json
import os
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pipeline.store import weights
from pipeline.store.fingerprint import (
    content_key,
    sample_id,
    teacher_fingerprint,
    teacher_fingerprint_info,
    tokenizer_fingerprint,
)
from pipeline.store.weights import record_path


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


# -- the fingerprint record (pipeline/store/weights.py) ------------------------------------------------------------


def _model(root, sizes=(3000, 5000)):
    """A model folder whose files are older than RACY_NS (as a downloaded teacher's are)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "n": 1}))
    rng = np.random.default_rng(0)
    for i, n in enumerate(sizes):
        (root / f"model-{i:05d}.safetensors").write_bytes(rng.bytes(n))
    _age(root)
    return root


def _age(root, seconds=100):
    old = time.time() - seconds
    for p in root.iterdir():
        os.utime(p, (old, old))


def _independent(root) -> str:
    """Scheme 2 computed here from its definition, without the record."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"gkd teacher fingerprint 2|")
    h.update(json.dumps(json.loads((root / "config.json").read_text()), sort_keys=True).encode())
    for p in sorted(root.glob("*.safetensors")):
        h.update(b"|" + p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).hexdigest().encode())
    return h.hexdigest()


def test_record_hashes_a_folder_once_and_rehashes_a_touched_file(tmp_path):
    root = _model(tmp_path / "m")
    fp, info = teacher_fingerprint_info(root)
    assert fp == _independent(root) and len(info["hashed"]) == 2 and info["kept"]
    fp2, info2 = teacher_fingerprint_info(root)
    assert (fp2, info2["hashed"], len(info2["reused"])) == (fp, [], 2)  # one full hash for two calls
    os.utime(root / "model-00001.safetensors", (time.time() - 50, time.time() - 50))  # touched: new mtime
    fp3, info3 = teacher_fingerprint_info(root)
    assert (fp3, info3["hashed"], info3["reused"]) == (fp, ["model-00001.safetensors"], ["model-00000.safetensors"])
    (root / "model-00001.safetensors").write_bytes(b"x" * 5000)  # a real change: new content, new mtime
    _age(root, 40)
    assert teacher_fingerprint(root) == _independent(root) != fp


def test_record_limit_same_size_and_mtime_is_not_seen(tmp_path):
    """The documented limit: a byte changed behind the record with size and mtime restored is not seen (the
    record's digest is used); --rehash (rehash=True) reads the bytes and finds it."""
    root = _model(tmp_path / "m")
    fp = teacher_fingerprint(root)
    path = root / "model-00000.safetensors"
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[7] ^= 0xFF
    with open(path, "r+b") as f:  # in place: the inode stays
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert teacher_fingerprint(root) == fp  # stale: trusted by size, mtime and inode
    assert teacher_fingerprint(root, rehash=True) == _independent(root) != fp
    assert teacher_fingerprint(root) == _independent(root)  # the rehash updated the record


def test_record_works_for_a_read_only_model_folder_and_skips_fresh_files(tmp_path):
    root = _model(tmp_path / "m")
    before = sorted(p.name for p in root.iterdir())
    root.chmod(0o555)
    try:
        assert teacher_fingerprint(root) == _independent(root)
        assert teacher_fingerprint_info(root)[1]["hashed"] == []
    finally:
        root.chmod(0o755)
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written into the model folder
    (root / "model-00000.safetensors").write_bytes(b"y" * 3000)  # modified just now: may share an mtime tick
    teacher_fingerprint(root)
    assert teacher_fingerprint_info(root)[1]["hashed"] == ["model-00000.safetensors"]  # racy: hashed again


def test_record_of_another_version_or_garbage_is_rehashed_cleanly(tmp_path):
    root = _model(tmp_path / "m")
    fp = teacher_fingerprint(root)
    rec = record_path(root)
    data = json.loads(rec.read_text())
    for entry in data["entries"].values():
        entry["digest"] = "0" * 64  # a wrong digest: must never become the identity
    rec.write_text(json.dumps({**data, "record_version": 99}))
    fp2, info = teacher_fingerprint_info(root)
    assert fp2 == fp and len(info["hashed"]) == 2
    rec.write_text("{not json")
    assert teacher_fingerprint_info(root) == (fp, {**info, "hashed": info["hashed"]})


def test_scheme_1_is_the_old_stream_and_is_recorded_too(tmp_path):
    root = _model(tmp_path / "m")
    h = hashlib.blake2b(digest_size=16)  # scheme 1 as descriptor < 1.5 caches computed it
    h.update(json.dumps(json.loads((root / "config.json").read_text()), sort_keys=True).encode())
    for p in sorted(root.glob("*.safetensors")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    fp, info = teacher_fingerprint_info(root, 1)
    assert fp == h.hexdigest() and len(info["hashed"]) == 2
    assert teacher_fingerprint_info(root, 1)[1]["hashed"] == []


def test_a_file_changing_while_hashed_is_read_again_then_refused(tmp_path):
    root = _model(tmp_path / "m")
    path = root / "model-00000.safetensors"
    touches = []

    def writer_during_read():
        """A hash object whose first update also stands for a concurrent writer (touches the file's mtime)."""
        h = hashlib.sha256()
        real = h.update

        class Hooked:
            def update(self, data):
                if len(touches) < limit:
                    touches.append(1)
                    os.utime(path, ns=(0, time.time_ns() - 10**9 * (50 + len(touches))))
                real(data)

            def hexdigest(self):
                return h.hexdigest()
        return Hooked()

    limit = 1  # changed during the first read only: read again, right digest
    digest, _ = weights.hash_file(path, writer_during_read)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() and len(touches) == 1
    touches.clear()
    limit = 2  # changes during every read: refused, naming the file
    with pytest.raises(weights.FingerprintError, match=r"model-00000\.safetensors: the file changed while it was being hashed"):
        weights.hash_file(path, writer_during_read)
