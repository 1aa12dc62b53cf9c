"""The bad-input catalogue (docs/bad-inputs.md): each row is a case here, run through the real CLI in-process.

Every case checks the same four things: a non-zero exit; a message naming the file, the field or value, and the
fix; no traceback (pipeline.errors.command prints a refusal as one message); and nothing already on disk harmed (every file there before is byte-identical after, no temporary or partial
file is left). No model is trained and no engine is started: every refusal comes before that work, which is the
point (a bad input must fail in seconds); the exception is the served vision-language teacher's two cases, refusals
of a real vLLM server's answers, which start one tiny server each. The trainer's checkpoint cases need a real checkpoint and live in
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
    assert "Traceback" not in err, f"a refusal printed a traceback: {err}"  # pipeline.errors.command's one job
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


def test_jsonl_with_a_byte_order_mark_is_read(tmp_path, teacher):
    """A UTF-8 file as Windows tools write it (EF BB BF first) imports to the same rollouts as the file without."""
    from pipeline.store.rollouts import iter_rollouts, rollout_shards

    text = b"".join(json.dumps({"prompt": f"what is {i}?", "response": f"{i}"}).encode() + b"\n" for i in range(3))
    ids = {}
    for name, data in (("plain", text), ("bom", b"\xef\xbb\xbf" + text)):
        (tmp_path / name).mkdir()
        assert gkd(_import(tmp_path / name, teacher, data)) == 0
        ids[name] = [(r["prompt_id"], list(r["prompt_ids"]), list(r["completion_ids"]))
                     for r in iter_rollouts(rollout_shards(tmp_path / name / "rollouts"))]
    assert len(ids["plain"]) == 3 and ids["bom"] == ids["plain"]


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


def test_topk_above_the_teacher_vocabulary(tmp_path, teacher, capsys):
    _rollouts(tmp_path, teacher, [_row(0)])
    vocab = json.loads((teacher / "config.json").read_text())["vocab_size"]
    refused(tmp_path, _score(tmp_path, teacher, None, "--topk", str(vocab + 1)), capsys,
            rf"topk={vocab + 1} is above the teacher's vocabulary \(.*config\.json: vocab_size={vocab}\)",
            rf"choose --topk <= {vocab}")
    assert not (tmp_path / "cache").exists()  # no cache.json recording the impossible k


def test_teacher_folder_without_tokenizer_files(tmp_path, teacher, capsys):
    import shutil

    _rollouts(tmp_path, teacher, [_row(0)])
    bare = tmp_path / "bare-teacher"
    bare.mkdir()
    for f in teacher.iterdir():
        if f.is_file() and "token" not in f.name and f.suffix != ".jinja":
            shutil.copy(f, bare / f.name)
    refused(tmp_path, _score(tmp_path, bare), capsys,
            r"bare-teacher: no tokenizer files \(none of tokenizer\.json, tokenizer\.model, vocab\.json",
            "copy the teacher's tokenizer.json and tokenizer_config.json")


def test_cache_path_is_a_file(tmp_path, teacher, capsys):
    _rollouts(tmp_path, teacher, [_row(0)])
    (tmp_path / "cache").write_text("not a cache")
    refused(tmp_path, _score(tmp_path, teacher), capsys, r"cache: is a file, not a teacher cache directory",
            "pass --cache a directory")


def test_cache_index_of_another_cache(tmp_path, capsys):
    """An index.jsonl copied in from another cache (or a cache.json edited under it) would hand the trainer another
    cache's keys and lengths: refused, naming the file and both identities, before anything is read."""
    from scored_rows import make_descriptor, make_row

    from pipeline.store import TeacherCache

    rng = np.random.default_rng(0)
    for name, teacher_fp in (("ours", "t" * 32), ("theirs", "u" * 32)):
        d = make_descriptor(k=4, vocab=64, teacher=teacher_fp)
        TeacherCache.create_or_open(tmp_path / name, d).write_shard("s-00000", [make_row(rng, d, 8, 2)])
    (tmp_path / "ours" / "index.jsonl").write_bytes((tmp_path / "theirs" / "index.jsonl").read_bytes())
    refused(tmp_path, ["cache", "stats", str(tmp_path / "ours")], capsys,
            rf"{tmp_path}/ours/index.jsonl: index of another cache \(identity \w+, this cache's .*cache.json gives \w+\)",
            rf"gkd cache index {tmp_path}/ours")


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
    from pipeline.score.config import ScoreConfig
    from pipeline.score.errors import TeacherOutputError
    from pipeline.score.extract import check_finite

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


# -- gkd score --teacher-url: the served teacher --------------------------------------------------------------


def test_a_key_in_the_teacher_url_is_refused(tmp_path, teacher, capsys):
    _rollouts(tmp_path, teacher, [_row(0)])
    secret = "sk-in-the-url-1234"
    for url in (f"https://{secret}@teacher.example:8000/v1", f"https://user:{secret}@teacher.example/v1",
                f"https://teacher.example/v1?api_key={secret}"):
        err = refused(tmp_path, _score(tmp_path, teacher, None, "--teacher-url", url), capsys,
                      r"teacher_url holds credentials in its (user/password part|query)", "--teacher-api-key-env VAR",
                      "OPENAI_API_KEY")
        assert secret not in err
    assert not (tmp_path / "cache").exists()


class _NotVllm:
    """A real HTTP server speaking the OpenAI API as a server that is not vLLM does: /v1/models and
    /v1/completions answer, without vLLM's `prompt_logprobs` field."""

    def __enter__(self) -> str:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _json(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._json({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._json({"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [
                    {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}]})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_port}/v1"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_endpoint_that_is_not_vllm_is_refused(tmp_path, teacher, capsys):
    _rollouts(tmp_path, teacher, [_row(0)])
    with _NotVllm() as url:
        refused(tmp_path, _score(tmp_path, teacher, None, "served_retries=0", "--teacher-url", url), capsys,
                r"/completions: the answer's choices\[0\] holds no 'prompt_logprobs' field", "is this a vLLM server",
                "python -m vllm.entrypoints.openai.api_server")
    assert not (tmp_path / "cache").exists()


# -- gkd cache import --------------------------------------------------------------------------------------------


def _synthetic_cache(tmp: Path, rows: list[dict], tokenizer: str, k: int = 4) -> Path:
    """A cache of made-up top-k rows for `rows` (no model: the import checks do not look at the values)."""
    from pipeline.store import Descriptor, TeacherCache
    from pipeline.store.codec import params
    from pipeline.store.rollouts import rollout_key

    d = Descriptor(teacher_fingerprint="t" * 16, tokenizer_fingerprint=tokenizer, k=k, logprob_mode="raw_logprobs",
                   vocab_size=400, codec=params("exact-f32"), numerics={"dtype": "float32"})
    cache = TeacherCache.create_or_open(tmp / "src-cache", d)
    out = []
    for r in rows:
        n = len(r["completion_ids"])
        out.append({"key": rollout_key(r, d.teacher_fingerprint, k, d.logprob_mode), "sample_id": r["sample_id"],
                    "source": "dataset", "policy_version": None, "input_ids": r["prompt_ids"] + r["completion_ids"],
                    "first_scored": len(r["prompt_ids"]), "topk_ids": np.tile(np.arange(1, k + 1), (n, 1)),
                    "topk_logprobs": np.tile(-np.arange(1.0, k + 1), (n, 1)), "actual_ranks": np.full(n, k + 1),
                    "actual_logprobs": np.full(n, -9.0)})
    cache.write_shard("scored-00000", out)
    return tmp / "src-cache"


def test_an_import_whose_tokenizer_k_or_rows_do_not_match_the_rollouts(tmp_path, capsys):
    from interop_files import write_distillkit

    rows = [_row(i) for i in range(3)]
    write_rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint="tok-a")
    assert gkd(["cache", "export", str(_synthetic_cache(tmp_path, rows, "tok-a")), "--out", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    base = ["cache", "import", "--rollouts", str(tmp_path / "rollouts"), "--cache", str(tmp_path / "cache")]
    assert gkd([*base, "--from", "plain", "--in", str(tmp_path / "plain")]) == 0  # the cache the next ones target
    capsys.readouterr()

    write_rollouts(tmp_path / "other" / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint="tok-b")
    refused(tmp_path, ["cache", "import", "--from", "plain", "--in", str(tmp_path / "plain"), "--rollouts",
                       str(tmp_path / "other"), "--cache", str(tmp_path / "cache2")], capsys,
            r"plain: exported from a cache of tokenizer tok-a, the rollouts .*other were tokenized with tok-b",
            "import against the rollouts that cache was scored on")

    def dk(name: str, k: int, ids=None, cache: str = "cache") -> list[str]:
        seqs = []
        for r in rows:
            x = np.asarray(ids if ids is not None else r["prompt_ids"] + r["completion_ids"])
            seqs.append((x, np.tile(np.arange(1, k + 1), (len(x) - 1, 1)), np.tile(-np.arange(1.0, k + 1), (len(x) - 1, 1))))
        write_distillkit(tmp_path / name, seqs, vocab=400, k=k)
        return ["cache", "import", "--rollouts", str(tmp_path / "rollouts"), "--cache", str(tmp_path / cache),
                "--from", "distillkit", "--in", str(tmp_path / name), "--teacher-fingerprint", "t" * 16]

    refused(tmp_path, dk("dk-k8", 8), capsys, r"cache\.json: these rows cannot be mixed into this cache",
            "k: cache has 4, this run has 8", "Import into another --cache directory")
    refused(tmp_path, dk("dk-rows", 4, ids=list(range(3, 15)), cache="cache3"), capsys,
            r"dk-rows/part-0\.parquet: row 0: its input_ids \(12 tokens", "equal no rollout's prompt_ids \\+ "
            "completion_ids; the tokens must match exactly")
    assert not (tmp_path / "cache2").exists() and not (tmp_path / "cache3").exists()
def test_distributed_optimizer_settings(tmp_path, capsys):
    refused(tmp_path, ["train", "use_distributed_optimizer=true", "optimizer=sgd"], capsys,
            r"use_distributed_optimizer=true needs optimizer=adam, got optimizer=sgd", r"set optimizer=adam, or")
    refused(tmp_path, ["train", "use_distributed_optimizer=true", "backend=hf", f"save_dir={tmp_path / 'run'}"],
            capsys, r"use_distributed_optimizer=true shards Megatron-Core's optimizer; .* hf backend",
            r"use fsdp=true there")


def test_context_parallel_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # torchrun's processes: 3 cannot hold CP groups of 2
    refused(tmp_path, ["train", "context_parallel_size=2", "micro_batch_size=2", "global_batch_size=2"], capsys,
            r"context_parallel_size 2 x tensor_model_parallel_size 1 = 2 does not divide the 3 processes \(WORLD_SIZE\)",
            r"launch a multiple of 2 processes or change context_parallel_size")
    monkeypatch.setenv("WORLD_SIZE", "2")
    refused(tmp_path, ["train", "context_parallel_size=2", "seq_length=30"], capsys,
            r"seq_length 30 is not a multiple of 2 x context_parallel_size = 4", r"e\.g\. 32")
    refused(tmp_path, ["train", "context_parallel_size=2", "attention=local"], capsys,
            r"context_parallel_size=2 needs attention=sdpa", r"Set attention=sdpa, or context_parallel_size=1")
    refused(tmp_path, ["train", "context_parallel_size=2", "backend=hf", f"save_dir={tmp_path / 'run'}"], capsys,
            r"context_parallel_size=2: the hf backend .* has no context parallelism",
            r"context_parallel_size=1 \(fsdp=true to shard it\), or on the Megatron backend")
    assert not (tmp_path / "run").exists()


def test_pipeline_parallel_settings(tmp_path, capsys, monkeypatch):
    """pipeline_model_parallel_size: refused before any process group or model (no save_dir appears) where the
    processes, the student's layers or the backend do not allow it, and by name for every key PP does not run with
    yet (issue 48's first cut)."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    refused(tmp_path, ["train", "pipeline_model_parallel_size=2", "micro_batch_size=2", "global_batch_size=2"], capsys,
            r"pipeline_model_parallel_size 2 x tensor_model_parallel_size 1 x context_parallel_size 1 = 2 does not "
            r"divide the 3 processes \(WORLD_SIZE\)", r"launch a multiple of 2 processes")
    monkeypatch.setenv("WORLD_SIZE", "4")  # the default student has 6 layers: 4 stages cannot hold them evenly
    refused(tmp_path, ["train", "pipeline_model_parallel_size=4", f"save_dir={tmp_path / 'run'}"], capsys,
            r"pipeline_model_parallel_size=4 does not divide the student's 6 layers", r"use a divisor of 6 \(2, 3, 6\)")
    monkeypatch.setenv("WORLD_SIZE", "2")
    refused(tmp_path, ["train", "pipeline_model_parallel_size=2", "backend=hf", f"save_dir={tmp_path / 'run'}"], capsys,
            r"pipeline_model_parallel_size=2: the hf backend .* has no pipeline parallelism", r"fsdp=true")
    for key, why in (("lora_rank=8 virtual_pipeline_model_parallel_size=3",
                      "lora_rank=8 and virtual_pipeline_model_parallel_size=3: an adapter's checkpoint holds one model"),
                     ("loss=gold", "loss=gold: the cross-tokenizer losses"),
                     ("teacher_live=x", "teacher_live: the live teacher")):
        extra = ["cache=[]", "rollouts=[r]"] if key.startswith("teacher_live") else []
        monkeypatch.setenv("WORLD_SIZE", "2")
        refused(tmp_path, ["train", "pipeline_model_parallel_size=2", *key.split(), *extra, f"save_dir={tmp_path / 'run'}"],
                capsys, f"pipeline_model_parallel_size=2 with {why}", "or pipeline_model_parallel_size=1")
    # virtual_pipeline_model_parallel_size (interleaved 1F1B): without pipeline stages, a chunk count that does not
    # divide a stage's layers (6 layers / 2 stages = 3), micro-batches fewer than, or not a multiple of, the stages
    refused(tmp_path, ["train", "virtual_pipeline_model_parallel_size=2", f"save_dir={tmp_path / 'run'}"], capsys,
            r"virtual_pipeline_model_parallel_size=2 interleaves model chunks over pipeline stages, but "
            r"pipeline_model_parallel_size=1", r"or virtual_pipeline_model_parallel_size=1")
    refused(tmp_path, ["train", "pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=2",
                       f"save_dir={tmp_path / 'run'}"], capsys,
            r"virtual_pipeline_model_parallel_size=2 does not divide the 3 layers per stage \(the student's 6 layers / "
            r"pipeline_model_parallel_size=2\)", r"use a divisor of 3 \(3\)")
    monkeypatch.setenv("WORLD_SIZE", "3")
    for batch, what, fit in ((4, "fewer than", 6), (8, "not a multiple of", 12)):
        refused(tmp_path, ["train", "pipeline_model_parallel_size=3", "virtual_pipeline_model_parallel_size=2",
                           "micro_batch_size=2", f"global_batch_size={batch}", f"save_dir={tmp_path / 'run'}"], capsys,
                rf"virtual_pipeline_model_parallel_size=2: {batch // 2} micro-batches a step \(global_batch_size "
                rf"{batch} / micro_batch_size 2 / 1 data-parallel ranks\) is {what} pipeline_model_parallel_size=3",
                rf"set global_batch_size={fit}, or virtual_pipeline_model_parallel_size=1")
    assert not (tmp_path / "run").exists()


# -- the catalogue is this file -----------------------------------------------------------------------------------


def test_every_catalogue_row_names_an_existing_test():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ") and "`test_" in line]
    named = {m for line in rows for m in re.findall(r"`(test_\w+)`", line)}
    here = set(re.findall(r"^def (test_\w+)", Path(__file__).read_text(), re.M))
    train = set(re.findall(r"^def (test_\w+)", (Path(__file__).parent / "train" / "test_refusals.py").read_text(), re.M))
    assert len(rows) >= 14 and named and named <= here | train, named - (here | train)


# -- images (gkd import --image-field, gkd score with a vision-language teacher) ---------------------------------


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict:
    """A tiny Qwen2-VL, image rollouts imported with its processor, and a text-only teacher of the same tokenizer."""
    import shutil

    from tiny_models import build_llama, build_qwen2_vl, draw_image

    root = tmp_path_factory.mktemp("vlm")
    model = build_qwen2_vl(root / "vlm")
    for name in ("a", "b"):
        draw_image(root / f"{name}.png", seed=ord(name))
    src = root / "vqa.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"what is {i}?", "response": f"{i}", "images": ["a.png", "b.png"]})
                           + "\n" for i in range(4)))
    assert gkd(["import", "--dataset", str(src), "--out", str(root / "rollouts"), "--tokenizer", str(model),
                "--image-field", "images"]) == 0
    text = root / "text"
    text.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model / f, text / f)
    build_llama(text, vocab_size=384, hidden=32, max_pos=128)
    return {"root": root, "model": model, "rollouts": root / "rollouts", "text": text}


def _image_import(tmp: Path, vlm: dict, images: list[str]) -> list[str]:
    src = tmp / "data.jsonl"
    src.write_text(json.dumps({"prompt": "what is 1?", "response": "1", "images": images}) + "\n")
    return ["import", "--dataset", str(src), "--out", str(tmp / "rollouts"), "--tokenizer", str(vlm["model"]),
            "--image-field", "images"]


def test_missing_image_file(tmp_path, vlm, capsys):
    refused(tmp_path, _image_import(tmp_path, vlm, ["nope.png"]), capsys,
            r"data\.jsonl: row '0': image .*nope\.png \(field 'images'\) cannot be read \(No such file",
            "relative to the dataset file's folder")
    assert not (tmp_path / "rollouts" / "images").exists()


def test_corrupt_image(tmp_path, vlm, capsys):
    import shutil

    shutil.copy(vlm["root"] / "a.png", tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    refused(tmp_path, _image_import(tmp_path, vlm, ["good.png", "bad.png"]), capsys,
            r"data\.jsonl: row '0': image 2, .*bad\.png: not a readable image", "replace the file with a PNG or JPEG")
    assert not (tmp_path / "rollouts" / "images").exists()  # the good image of the refused row is not stored either


def test_image_url_is_refused_as_a_url(tmp_path, vlm, capsys):
    """Was: reported as a missing file named `http:/...`."""
    err = refused(tmp_path, _image_import(tmp_path, vlm, ["https://example.com/a.png"]), capsys,
                  r"data\.jsonl: row '0': field 'images' holds the URL 'https://example\.com/a\.png'; URLs are not "
                  r"fetched: download the images and give their paths")
    assert "http:/" not in err.replace("https://", "")


def test_a_file_that_is_not_an_image_names_its_row_and_path(tmp_path, vlm, capsys):
    """Was: "image 1: not a readable image (cannot identify image file <_io.BytesIO object at 0x...>)"."""
    (tmp_path / "notes.txt").write_text("not an image\n")
    err = refused(tmp_path, _image_import(tmp_path, vlm, ["notes.txt"]), capsys,
                  r"data\.jsonl: row '0': image 1, \S*notes\.txt: not a readable image \(no image format PIL knows\)",
                  "replace the file with a PNG or JPEG", "--on-bad skip")
    assert "BytesIO" not in err


def test_on_bad_skip_skips_a_row_whose_file_is_not_an_image(tmp_path, vlm, capsys):
    """Was: --on-bad skip still stopped at such a row. The summary counts it; with nothing skipped it says nothing
    (was: `({} skipped)`)."""
    import shutil

    from pipeline.store.rollouts import iter_rollouts, rollout_shards

    shutil.copy(vlm["root"] / "a.png", tmp_path / "good.png")
    (tmp_path / "notes.txt").write_text("not an image\n")
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"what is {i}?", "response": f"{i}", "images": [im]}) + "\n"
                           for i, im in enumerate(["good.png", "notes.txt", "good.png"])))
    argv = ["import", "--dataset", str(src), "--tokenizer", str(vlm["model"]), "--image-field", "images"]
    assert gkd([*argv, "--out", str(tmp_path / "skip"), "--on-bad", "skip"]) == 0
    out = capsys.readouterr().out
    assert "3 rows (1 skipped: unreadable_image 1)" in out, out
    assert sorted(r["prompt_id"] for r in iter_rollouts(rollout_shards(tmp_path / "skip"))) == ["0", "2"]
    assert len(list((tmp_path / "skip" / "images").iterdir())) == 1  # the skipped row's file is not stored
    src.write_text(json.dumps({"prompt": "what is 1?", "response": "1", "images": ["good.png"]}) + "\n")
    assert gkd([*argv, "--out", str(tmp_path / "clean")]) == 0
    out = capsys.readouterr().out
    assert "skipped" not in out and "{}" not in out and "1 rollouts of 1 rows, " in out, out


def _vlm_score(tmp: Path, rollouts: Path, teacher: Path, *extra: str) -> list[str]:
    return ["score", "--rollouts", str(rollouts), "--cache", str(tmp / "cache"), "--teacher", str(teacher),
            "--topk", "4", "max_model_len=128", *extra]


def test_more_images_than_the_engine_limit(tmp_path, vlm, capsys):
    refused(tmp_path, _vlm_score(tmp_path, vlm["rollouts"], vlm["model"], "max_images_per_prompt=1"), capsys,
            r"4 rollout\(s\) with images cannot be scored: sample \w+: 2 images, more than max_images_per_prompt=1",
            "raise it")


def test_image_rollouts_for_a_text_only_teacher(tmp_path, vlm, capsys):
    refused(tmp_path, _vlm_score(tmp_path, vlm["rollouts"], vlm["text"]), capsys,
            r"sample \w+: it has 2 image\(s\), and the teacher is a text-only model \(its config\.json has no "
            "vision_config\\)", "score it with a vision-language teacher")


def test_teacher_processor_expands_images_differently(tmp_path, vlm, capsys):
    """The student's processor made 6 + 4 placeholders; a teacher whose processor allows fewer pixels per image
    (another max_pixels) would score other positions: refused before the engine starts, naming the sample."""
    import shutil

    other = tmp_path / "teacher"
    shutil.copytree(vlm["model"], other)
    config = json.loads((other / "processor_config.json").read_text())
    config["image_processor"]["size"]["longest_edge"] = 28 * 28 * 4
    (other / "processor_config.json").write_text(json.dumps(config))
    refused(tmp_path, _vlm_score(tmp_path, vlm["rollouts"], other), capsys,
            r"sample \w+: image 1 \(\w+\) has 6 placeholder tokens in the rollout \(the student's processor\) but "
            r"the teacher's processor .* expands it to [0-5]:", "max_pixels/min_pixels", "nothing was scored")
    assert not (tmp_path / "cache" / "shards").exists() or not list((tmp_path / "cache" / "shards").iterdir())


def test_image_missing_from_the_rollouts_folder(tmp_path, vlm, capsys):
    import shutil

    shutil.copytree(vlm["rollouts"], tmp_path / "rollouts")
    victim = sorted((tmp_path / "rollouts" / "images").iterdir())[0]
    victim.unlink()
    refused(tmp_path, _vlm_score(tmp_path, tmp_path / "rollouts", vlm["model"]), capsys,
            rf"images/{victim.name}: image \(sample \w+\) is missing", "copy the rollouts' images/ folder")


# -- gkd score --teacher-url with image rollouts: the two cases need the server's own answer, so they start one
# real vLLM server of the tiny Qwen2-VL each (~25 s on 2 cores), the only engines this module starts ------------


@pytest.mark.slow  # two vLLM servers, ~100 s; CI: the served VLM teacher's own tests (tests/score/test_served_images.py)
def test_a_served_vlm_teacher_without_the_token_endpoint_or_with_another_processor(tmp_path, tmp_path_factory, vlm,
                                                                                  capsys):
    """A server started without --enable-scale-out has no token-in endpoint, which the images go through: refused
    at the probe, before the cache is touched. A server whose processor expands the images to fewer placeholders
    (another max_pixels in its folder) than the rollouts and the local teacher folder hold: refused at the first
    answer, naming the sample and both expansions, nothing stored."""
    import shutil

    from vllm_server import LocalServer

    work = tmp_path_factory.mktemp("served-vlm-refusals")
    other = work / "teacher"
    shutil.copytree(vlm["model"], other)
    config = json.loads((other / "processor_config.json").read_text())
    config["image_processor"]["size"]["longest_edge"] = 28 * 28 * 4
    (other / "processor_config.json").write_text(json.dumps(config))
    limit = ["--limit-mm-per-prompt", json.dumps({"image": 2})]
    kw = dict(name="vl", max_logprobs=4, max_model_len=129, kv_cache_gib=0.05,
              env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    with LocalServer(vlm["model"], work / "plain.log", extra=limit, **kw) as server:
        refused(tmp_path, _vlm_score(tmp_path, vlm["rollouts"], vlm["model"], "--teacher-url", server.url), capsys,
                r"/inference/v1/generate: the server refused the request \(HTTP 403\)",
                "restart it with that flag", "--enable-scale-out")
    assert not (tmp_path / "cache").exists()
    with LocalServer(other, work / "other.log", extra=["--enable-scale-out", *limit], **kw) as server:
        refused(tmp_path, _vlm_score(tmp_path, vlm["rollouts"], vlm["model"], "--teacher-url", server.url), capsys,
                r"sample \w+: the teacher's server expanded its images to \[[0-5], [0-5]\] placeholder tokens .*, "
                r"the rollout holds \[6, 6\]", "processors differ", "nothing of this part was written")
    assert not list((tmp_path / "cache" / "shards").glob("*.parquet"))


# -- gkd onpolicy: overlapped cycles ------------------------------------------------------------------------------


def test_max_staleness_negative_or_with_a_loss_that_refuses_it(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["onpolicy", f"out={out}", f"cache={out / 'cache'}", "lmbda=1.0", "offpolicy_dataset=null",
            "offpolicy_cache=null"]
    refused(tmp_path, [*base, "max_staleness=-1"], capsys, r"max_staleness must be an integer >= 0 .*got -1")
    refused(tmp_path, [*base, "max_staleness=1", "train.loss=opd", "train.opd_is_cap=null"], capsys,
            r"max_staleness=1 with train.loss=opd and train.opd_is_cap=null", r"set train.opd_is_cap \(e.g. 2\)")
    refused(tmp_path, [*base, "train.opd_is_cap=0.5"], capsys, r"opd_is_cap must be a number >= 1 .*got 0.5")
    assert not out.exists()  # refused before the run's folder is made


def test_kd_alpha_negative_with_another_loss_or_with_nothing_to_train(tmp_path, capsys):
    refused(tmp_path, ["train", "kd_alpha=-1"], capsys, r"kd_alpha must be >= 0, got -1")
    refused(tmp_path, ["train", "kd_alpha=0.5", "loss=opd"], capsys,
            r"kd_alpha weighs the loss=gkd divergence; loss=opd takes none: drop kd_alpha")
    refused(tmp_path, ["train", "kd_alpha=0"], capsys,
            r"kd_alpha=0 with sft_alpha=0 trains on nothing: set sft_alpha > 0 \(SFT on the dataset rows\)")


# -- the exact teacher: hidden-state caches (gkd score teacher_rows=hidden, store/hidden.py) -------------------


def test_hidden_rows_of_a_teacher_whose_logits_are_not_linear(tmp_path, teacher, capsys):
    import shutil

    _rollouts(tmp_path, teacher, [_row(0)])
    capped = tmp_path / "capped-teacher"
    shutil.copytree(teacher, capped)
    config = json.loads((capped / "config.json").read_text())
    (capped / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    refused(tmp_path, _score(tmp_path, capped, None, "teacher_rows=hidden"), capsys,
            r"capped-teacher/config\.json: final_logit_softcapping=30\.0: this teacher's logits are not a linear map",
            r"score it with teacher_rows=topk")
    assert not (tmp_path / "cache").exists()


@pytest.fixture(scope="module")
def exact(tmp_path_factory, teacher) -> dict:
    """A hidden-state cache and a top-k cache of the same teacher (HF forward), and a student of a wider vocabulary."""
    from tiny_cache import hidden_cache_from_hf, random_samples, score_into_cache
    from tiny_models import build_llama, build_tokenizer

    root = tmp_path_factory.mktemp("exact")
    vocab = json.loads((teacher / "config.json").read_text())["vocab_size"]
    samples = random_samples(4, vocab)
    hidden_cache_from_hf(teacher, root / "hidden", samples)
    score_into_cache(teacher, root / "topk", samples)
    wide = root / "wide"
    tok = build_tokenizer(wide)
    build_llama(wide, vocab_size=len(tok) + 16, layers=1, hidden=32, heads=1, kv_heads=1)
    return {"hidden": root / "hidden", "topk": root / "topk", "wide": wide, "vocab": vocab}


def _train_exact(tmp: Path, student: Path, cache: str, *extra: str) -> list[str]:
    return ["train", f"student={student}", f"cache={cache}", "micro_batch_size=1", "global_batch_size=1",
            "seq_length=64", "train_steps=2", "warmup_steps=1", f"save_dir={tmp / 'run'}", "progress=false", *extra]


def test_hidden_cache_mixed_with_a_topk_cache(tmp_path, teacher, exact, capsys):
    refused(exact["hidden"].parent, _train_exact(tmp_path, teacher, f"[{exact['hidden']},{exact['topk']}]"), capsys,
            rf"{exact['hidden']}/cache\.json: teacher_rows=hidden, but {exact['topk']}/cache\.json is a top-k cache",
            r"train the hidden-state caches alone")
    assert not (tmp_path / "run").exists()


def test_hidden_cache_export(tmp_path, exact, capsys):
    """`gkd cache export` writes top-k rows per position: a hidden-state cache's states would be dropped, so it is
    refused, naming the cache and the two ways to its rows; no export folder appears."""
    out = tmp_path / "plain"
    refused(exact["hidden"].parent, ["cache", "export", str(exact["hidden"]), "--out", str(out)], capsys,
            rf"{exact['hidden']}/cache\.json: teacher_rows=hidden: a hidden-state cache holds the teacher's final "
            r"hidden states", r"topk_from_hidden=K", r"score the rollouts into a top-k cache")
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_hidden_cache_with_a_student_of_another_vocabulary(tmp_path, exact, capsys):
    refused(exact["hidden"].parent, _train_exact(tmp_path, exact["wide"], f"[{exact['hidden']}]"), capsys,
            rf"wide/config\.json: vocab_size={exact['vocab'] + 16}, the teacher's is {exact['vocab']}",
            r"score a top-k cache \(teacher_rows=topk\)")


def test_temperature_at_or_below_zero(tmp_path, teacher, exact, capsys):
    for tau in ("0", "-0.5"):
        refused(exact["hidden"].parent, _train_exact(tmp_path, teacher, f"[{exact['hidden']}]", f"temperature={tau}"),
                capsys, rf"temperature must be > 0, got {float(tau)}")
