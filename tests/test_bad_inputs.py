"""The bad-input catalogue (docs/bad-inputs.md): each row is a case here, run through the real CLI in-process.

Every case checks the same three things: a non-zero exit; a message naming the file, the field or value, and the
fix; and nothing already on disk harmed (every file there before is byte-identical after, no temporary or partial
file is left). No model is trained and no engine is started: every refusal comes before that work, which is the
point (a bad input must fail in seconds). The trainer's checkpoint cases need a real checkpoint and live in
tests/train/test_refusals.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.cli import main as gkd
from pipeline.store.rollouts import rollout_row, write_rollouts
from pipeline.store.shards import atomic_write_bytes, marker_path

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-inputs.md"
MAX_LEN = 64


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    from tiny_models import build_tiny_teacher

    return build_tiny_teacher(tmp_path_factory.mktemp("teacher"), hidden=32, max_pos=128)


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def refused(tmp: Path, argv: list[str], capsys, *patterns: str) -> str:
    """Run `gkd ARGV`; assert exit 2, every regex in the message, and nothing under `tmp` harmed."""
    before = _snapshot(tmp)
    rc = gkd(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    for pat in patterns:
        assert re.search(pat, err), f"{pat!r} not in: {err}"
    after = _snapshot(tmp)
    assert {k: v for k, v in after.items() if k in before} == before, "a file that was there before changed"
    left = [k for k in after if k not in before and (Path(k).name.startswith(".") or ".partial" in k)]
    assert not left, f"temporary files left behind: {left}"
    return err


# -- gkd import: prompt files ------------------------------------------------------------------------------------


def _import(tmp: Path, teacher: Path, data: bytes, *extra: str) -> list[str]:
    src = tmp / "data.jsonl"
    src.write_bytes(data)
    return ["import", "--dataset", str(src), "--out", str(tmp / "rollouts"), "--tokenizer", str(teacher), *extra]


@pytest.fixture
def imported(tmp_path, teacher) -> Path:
    """An output folder that already holds a complete shard 0/2: a refused shard-1 import must leave it alone."""
    good = b"".join(json.dumps({"prompt": f"what is {i}?", "response": f"{i}"}).encode() + b"\n" for i in range(8))
    assert gkd(_import(tmp_path, teacher, good, "--shard", "0", "--num-shards", "2")) == 0
    return tmp_path


def test_malformed_jsonl_line(imported, teacher, capsys):
    data = b'{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": \n'
    refused(imported, _import(imported, teacher, data, "--shard", "1", "--num-shards", "2"), capsys,
            r"data\.jsonl:2: not valid JSON", "fix or remove that line")


def test_missing_or_misspelled_field(imported, teacher, capsys):
    data = b'{"promt": "a", "response": "b"}\n'
    refused(imported, _import(imported, teacher, data, "--shard", "1", "--num-shards", "2"), capsys,
            r"data\.jsonl: no field 'prompt' \(fields: promt, response\)", "--prompt-field")


def test_empty_prompt(imported, teacher, capsys):
    data = b'{"prompt": "", "response": "b"}\n' * 4
    refused(imported, _import(imported, teacher, data, "--shard", "1", "--num-shards", "2"), capsys,
            r"data\.jsonl: row '\d+': empty prompt \(the prompt field", "--on-bad skip")


def test_non_utf8_bytes(imported, teacher, capsys):
    data = b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n'
    refused(imported, _import(imported, teacher, data, "--shard", "1", "--num-shards", "2"), capsys,
            r"data\.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)", "re-encode the file as UTF-8")


def test_row_longer_than_max_len_on_import(imported, teacher, capsys):
    data = b"".join(json.dumps({"prompt": "the cat " * 40, "response": "b"}).encode() + b"\n" for _ in range(4))
    refused(imported, _import(imported, teacher, data, "--shard", "1", "--num-shards", "2", "--max-len", "32"),
            capsys, r"data\.jsonl: row '\d+': too long", "raise --max-len")


# -- gkd score: rollouts, cache folder ---------------------------------------------------------------------------


def _rollouts(tmp: Path, teacher: Path, rows: list[dict]) -> Path:
    from pipeline.store.fingerprint import tokenizer_fingerprint

    write_rollouts(tmp / "rollouts" / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint=tokenizer_fingerprint(teacher))
    return tmp / "rollouts"


def _row(i: int, prompt: int = 4, completion: int = 8, high: int = 300) -> dict:
    rng = np.random.default_rng(i)
    return rollout_row(prompt_id=f"q{i}", prompt_ids=rng.integers(3, high, prompt).tolist(),
                       completion_ids=rng.integers(3, high, completion).tolist(), source="dataset")


def _score(tmp: Path, teacher: Path, cache: Path | None = None, *extra: str) -> list[str]:
    return ["score", "--rollouts", str(tmp / "rollouts"), "--cache", str(cache or tmp / "cache"), "--teacher",
            str(teacher), "--topk", "4", f"max_model_len={MAX_LEN}", *extra]


def test_prompt_longer_than_max_model_len(tmp_path, teacher, capsys):
    _rollouts(tmp_path, teacher, [_row(0), _row(1, prompt=MAX_LEN + 4)])
    refused(tmp_path, _score(tmp_path, teacher), capsys,
            r"rollouts: 1 rollout\(s\) are longer than 64 tokens \(max_model_len", "raise max_model_len",
            "on_overlong=skip")


def test_generate_max_model_len_above_the_model(tmp_path, teacher, capsys):
    """vLLM's own length check (before any weight loads), as one line naming the model's config and the fix."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "what is 1?"}) + "\n")
    refused(tmp_path, ["generate", f"prompts={prompts}", f"out={tmp_path / 'rollouts'}", f"student={teacher}",
                       "max_model_len=4096", "max_tokens=4", "kv_cache_gib=0.05", "enforce_eager=true"], capsys,
            r"config\.json: max_model_len=4096 is above the model's limit \(max_position_embeddings=128\)",
            "lower max_model_len")


def test_token_ids_outside_the_vocabulary(tmp_path, teacher, capsys):
    _rollouts(tmp_path, teacher, [_row(0), _row(1, high=100_000)])
    refused(tmp_path, _score(tmp_path, teacher), capsys,
            r"rollouts: 1 rollout\(s\) hold token ids \(prompt_ids/completion_ids\) outside the teacher's vocabulary",
            "Re-create them with the teacher's tokenizer")


def test_cache_path_is_a_file(tmp_path, teacher, capsys):
    _rollouts(tmp_path, teacher, [_row(0)])
    (tmp_path / "cache").write_text("not a cache")
    refused(tmp_path, _score(tmp_path, teacher), capsys, r"cache: is a file, not a teacher cache directory",
            "pass --cache a directory")


def test_read_only_cache_directory(tmp_path, teacher, capsys):
    """On a read-only mount (root: a tmpfs remounted ro), where permission bits would not stop root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only tmpfs (CI runs as root)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        _rollouts(tmp_path / "bad", teacher, [_row(0, high=100_000)])
        assert gkd(_score(tmp_path / "bad", teacher, mnt / "cache")) == 2  # creates the cache, refuses the rows
        _rollouts(tmp_path, teacher, [_row(0)])  # now good rollouts, a read-only cache
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        capsys.readouterr()
        refused(tmp_path, _score(tmp_path, teacher, mnt / "cache"), capsys,
                r"cache/tasks.*(Read-only file system|EROFS)", "writable filesystem")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_rollout_shard_of_a_newer_schema_major(tmp_path, teacher, capsys):
    path = _rollouts(tmp_path, teacher, [_row(0)]) / "r-00000-of-00001.parquet"
    table = pq.read_table(path)
    meta = {**table.schema.metadata}
    tag = next(k for k, v in meta.items() if v.startswith(b"rollout/"))
    table = table.replace_schema_metadata({**meta, tag: b"rollout/9.0"})
    pq.write_table(table, path)
    marker = json.loads(marker_path(path).read_text())
    marker.update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(), bytes=path.stat().st_size)
    atomic_write_bytes(marker_path(path), json.dumps(marker).encode())
    refused(tmp_path, _score(tmp_path, teacher), capsys,
            r"r-00000-of-00001\.parquet: rollout schema version 9\.0 is not readable",
            r"use a pipeline release that writes rollout 9\.x, or re-create the file")


def test_nan_logprobs_from_the_engine_are_refused(teacher):
    """The check on every engine output (check_finite) before a part is written; an engine that returns NaN
    cannot be had from a healthy model, so the engine's arrays are given here."""
    from pipeline.score.scorer import ScoreConfig, TeacherOutputError, check_finite

    got = {"topk_logprobs": np.array([[-0.1, -2.0], [np.nan, -3.0]], np.float32),
           "actual_logprobs": np.array([-0.1, -1.0], np.float32)}
    cfg = ScoreConfig(rollouts="R", cache="C", teacher=str(teacher), dtype="bfloat16")
    with pytest.raises(TeacherOutputError, match=r"nan in topk_logprobs for sample s7 of R at position 6 .*dtype=float32"):
        check_finite(got, {"sample_id": "s7", "first_scored": 5}, teacher, cfg)
    check_finite({**got, "topk_logprobs": np.nan_to_num(got["topk_logprobs"])}, {"sample_id": "s7", "first_scored": 5},
                 teacher, cfg)


def test_unreadable_weight_file(tmp_path, teacher, capsys):
    """A weight file that cannot be read (a Hugging Face snapshot symlink whose blob is gone; permission bits do not
    stop root, who runs CI): refused before the cache is created or an engine started, by `gkd score` and
    `gkd fingerprint` alike."""
    import shutil

    model = tmp_path / "teacher"
    shutil.copytree(teacher, model)
    (model / "model-00002-of-00002.safetensors").symlink_to(tmp_path / "blobs" / "gone")
    _rollouts(tmp_path, teacher, [_row(0)])
    refused(tmp_path, _score(tmp_path, model), capsys,
            r"teacher/model-00002-of-00002\.safetensors: cannot read this weight file", "download the model again")
    assert not (tmp_path / "cache").exists()
    refused(tmp_path, ["fingerprint", str(model)], capsys, r"model-00002-of-00002\.safetensors: cannot read")


def test_weight_file_changing_while_hashed(tmp_path):
    """A model folder being written (a download, a copy) while it is hashed: read once more, then refused, never a
    digest of bytes that were never on disk together (tests/store/test_fingerprint.py drives the writer)."""
    from pipeline.store.weights import FingerprintError, hash_file

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * 4096)

    class Growing:  # each read sees the file grow, as a download does
        def __init__(self):
            import hashlib as hl
            self.h = hl.sha256()

        def update(self, data):
            with open(path, "ab") as f:
                f.write(b"\1")
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    with pytest.raises(FingerprintError, match=r"model\.safetensors: the file changed while it was being hashed .*"
                                               r"wait until whatever writes the model folder is done"):
        hash_file(path, Growing)


# -- config: unknown keys, sizes ---------------------------------------------------------------------------------


def test_unknown_config_key(tmp_path, teacher, capsys):
    refused(tmp_path, ["train", "lrr=1e-3"], capsys, r"unknown key 'lrr'")
    refused(tmp_path, _score(tmp_path, teacher, None, "max_model_lenn=5"), capsys, r"unknown key 'max_model_lenn'")


def test_zero_or_negative_sizes(tmp_path, teacher, capsys):
    refused(tmp_path, ["train", "micro_batch_size=0"], capsys, r"micro_batch_size must be >= 1, got 0")
    refused(tmp_path, ["train", "seq_length=-4"], capsys, r"seq_length must be >= 1, got -4")
    refused(tmp_path, _score(tmp_path, teacher, None, "--topk", "-1"), capsys, r"topk must be >= 0, got -1")
    refused(tmp_path, _score(tmp_path, teacher, None, "part_rows=-1"), capsys, r"part_rows must be >= 1")


def test_global_batch_size_not_divisible(tmp_path, capsys, monkeypatch):
    refused(tmp_path, ["train", "micro_batch_size=2", "global_batch_size=5"], capsys,
            r"global_batch_size 5 is not a multiple of micro_batch_size 2 x data-parallel size 1", "e.g. 4")
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun's 4 processes at tp 2: data-parallel 2
    refused(tmp_path, ["train", "micro_batch_size=2", "global_batch_size=6", "tensor_model_parallel_size=2"], capsys,
            r"global_batch_size 6 is not a multiple of .* data-parallel size 2 .* = 4", "e.g. 4")


# -- the catalogue is this file -----------------------------------------------------------------------------------


def test_every_catalogue_row_names_an_existing_test():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ") and "`test_" in line]
    named = {m for line in rows for m in re.findall(r"`(test_\w+)`", line)}
    here = set(re.findall(r"^def (test_\w+)", Path(__file__).read_text(), re.M))
    train = set(re.findall(r"^def (test_\w+)", (Path(__file__).parent / "train" / "test_refusals.py").read_text(), re.M))
    assert len(rows) >= 14 and named and named <= here | train, named - (here | train)
