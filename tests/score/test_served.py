"""Scoring through a real vLLM OpenAI-compatible server of the tiny teacher (pipeline/score/served/).

One server process serves the module (`server`, restarted only when a test needs another model or flags: three
starts of ~30-50 s in all); it runs in its own process group and is killed with it however a test ends. It is
started as a server off localhost would be: with an API key (VLLM_API_KEY, a fresh random one per run, so a scan
for it cannot match by chance) and over https with a self-signed certificate (SSL_CERT_FILE names it here, as a
user names a private CA's bundle); every test scores with the key, read from KEY_ENV.
"""

import logging
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from scored_rows import write_random_rollouts
from vllm_server import LocalServer

from pipeline.score.config import ScoreConfig
from pipeline.score.extract import extract
from pipeline.score.scorer import score
from pipeline.score.served.access import ServedTeacherError
from pipeline.score.served.logprobs import CLAMPED_LOGPROB, flat_from_json
from pipeline.store import CacheMismatchError, TeacherCache, read_cache

MAX_LEN = 96
K = 8
NAME = "tiny"
# served vs in-process logprobs of the same rollouts (exact-f32 codec, so nothing is rounded on the way): the same
# vLLM engine code, the same fp32 weights; they differ only by batch composition (the server batches the queued
# requests as it likes). Measured 0.0 on 2 CPU cores (bit-identical); the bound leaves room for other batchings.
TOLERANCE = 1e-4
KEY_ENV = "GKD_TEST_TEACHER_KEY"
KEY = "sk-gkd-" + secrets.token_hex(16)


@pytest.fixture(scope="module", autouse=True)
def served_env(tmp_path_factory):
    """The module's key (in KEY_ENV only: the defaults OPENAI_API_KEY / VLLM_API_KEY unset) and the server's
    certificate trusted through SSL_CERT_FILE; the environment is restored afterwards."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, KEY)
        mp.setenv("SSL_CERT_FILE", str(cert))
        mp.delenv("OPENAI_API_KEY", raising=False)
        mp.delenv("VLLM_API_KEY", raising=False)
        yield {"cert": cert, "key": key}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from tiny_models import build_tiny_teacher

    return build_tiny_teacher(tmp_path_factory.mktemp("teacher"), scale=30.0, max_pos=128)


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory):
    """Same architecture and tokenizer, another seed: a different model that could sit behind the same URL."""
    from tiny_models import build_tiny_teacher

    return build_tiny_teacher(tmp_path_factory.mktemp("other"), seed=1, scale=30.0, max_pos=128)


class Server:
    """The module's one server: `use(model, max_logprobs)` restarts it only when those change."""

    def __init__(self, log: Path, tls: tuple[Path, Path]) -> None:
        self.log, self.tls = log, tls
        self.current: LocalServer | None = None
        self.port = None
        self.starts = 0

    def use(self, model: Path, max_logprobs: int = K) -> LocalServer:
        c = self.current
        if c is None or c.proc is None or (c.model_dir, c.max_logprobs) != (Path(model), max_logprobs):
            self.stop()
            self.current = LocalServer(model, self.log, name=NAME, max_logprobs=max_logprobs,
                                       max_model_len=MAX_LEN + 1, kv_cache_gib=0.05, port=self.port,
                                       tls=self.tls,  # one process (~35% faster start); the key by environment
                                       env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_API_KEY": KEY})
            self.port = self.current.port  # the same URL throughout: test 3 swaps the model behind it
            self.current.start()
            self.starts += 1
        return self.current

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, served_env):
    s = Server(tmp_path_factory.mktemp("server") / "server.log", (served_env["cert"], served_env["key"]))
    try:
        yield s
    finally:
        s.stop()  # by process group: no orphan engine survives a failing test
        print(f"\n[served] {s.starts} server start(s), log {s.log}")


def _rollouts(path: Path, teacher: Path, specs, seed: int = 0) -> list[dict]:
    return write_random_rollouts(path, teacher, specs, seed)


def _cfg(tmp: Path, teacher: Path, **kw) -> ScoreConfig:
    base = dict(rollouts=str(tmp / "rollouts"), cache=str(tmp / "cache"), teacher=str(teacher), topk=K,
                max_model_len=MAX_LEN, part_rows=4, batch_tokens=256, codec="exact-f32")
    return ScoreConfig(**{**base, **kw})


def _served(server_: LocalServer, **kw) -> dict:
    return {"teacher_url": server_.url, "teacher_model": NAME, "teacher_api_key_env": KEY_ENV, **kw}


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


# -- no server needed ---------------------------------------------------------------------------------------------


def test_json_prompt_logprobs_become_the_in_process_flat_layout():
    """k+1 entries per position (actual first, then ranks 1..k) whether or not x_j is in the top k, -9999 = -inf."""
    ids = np.array([5, 7, 9])

    def e(lp, rank):
        return {"logprob": lp, "rank": rank, "decoded_token": "x"}

    out = [None,
           {"7": e(-5.0, 4), "1": e(-0.5, 1), "2": e(-1.5, 2), "3": e(-2.5, 3)},   # x_1 outside the top 3
           {"2": e(-1.0, 2), "9": e(-0.2, 1), "4": e(CLAMPED_LOGPROB, 3)}]        # x_2 = rank 1, in the top 3
    flat = flat_from_json(out, ids, 3)
    assert list(flat.start_indices) == [0, 0, 4] and list(flat.end_indices) == [0, 4, 8]
    assert list(flat.token_ids) == [7, 1, 2, 3, 9, 9, 2, 4] and list(flat.ranks) == [4, 1, 2, 3, 1, 1, 2, 3]
    assert np.isneginf(flat.logprobs[-1])
    got = extract(flat, ids, 1, 3)
    assert got["topk_ids"].tolist() == [[1, 2, 3], [9, 2, 4]] and got["actual_ranks"].tolist() == [4, 1]
    np.testing.assert_allclose(got["actual_logprobs"], [-5.0, -0.2])
    with pytest.raises(ServedTeacherError, match="lack the actual token 9"):
        flat_from_json([None, out[1], {"1": e(-1.0, 1), "2": e(-2.0, 2), "3": e(-3.0, 3)}], ids, 3)


def test_where_the_key_comes_from_and_what_a_url_may_hold(monkeypatch, tmp_path):
    """The named variable, else OPENAI_API_KEY, else VLLM_API_KEY; a named but unset variable is refused; a URL with
    credentials is refused without echoing them; a CA bundle path that is not a file is one clear message."""
    from pipeline.score.served.access import api_key_from_env, ssl_context, url_problems

    for name in ("OPENAI_API_KEY", "VLLM_API_KEY", "MY_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert api_key_from_env(None) == (None, "OPENAI_API_KEY or VLLM_API_KEY")
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert api_key_from_env(None) == ("v", "VLLM_API_KEY")
    monkeypatch.setenv("OPENAI_API_KEY", "o")
    assert api_key_from_env(None) == ("o", "OPENAI_API_KEY")
    with pytest.raises(ServedTeacherError, match="the environment variable MY_KEY is not set"):
        api_key_from_env("MY_KEY")
    monkeypatch.setenv("MY_KEY", "m")
    assert api_key_from_env("MY_KEY") == ("m", "MY_KEY")
    assert url_problems("https://host:8000/v1") == [] and url_problems("http://h/v1?model=x") == []
    for url in ("https://s3cr3t@host/v1", "https://u:s3cr3t@host/v1", "https://host/v1?token=s3cr3t"):
        (problem,) = url_problems(url)
        assert "holds credentials" in problem and "s3cr3t" not in problem and "***" in problem
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "nope.pem"))
    with pytest.raises(ServedTeacherError, match="SSL_CERT_FILE=.*nope.pem: no such file"):
        ssl_context()


def test_a_served_teacher_is_refused_with_an_adapter_or_without_a_url(tmp_path, teacher):
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="teacher_adapter cannot be applied to a served teacher"):
        score(_cfg(tmp_path, teacher, teacher_url="http://127.0.0.1:9/v1", teacher_adapter=str(tmp_path)))
    with pytest.raises(ConfigError, match="teacher_model names a served model: pass teacher_url too"):
        score(_cfg(tmp_path, teacher, teacher_model="tiny"))


# -- against a real server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scored(tmp_path_factory, teacher, server):
    """The module's rollouts scored once through the server (by the CLI) into a served cache."""
    from pipeline.score.run import main

    tmp = tmp_path_factory.mktemp("scored")
    # prompt/completion boundaries, a length-1 completion, one ending exactly at max_model_len, and a batch's worth
    rows = _rollouts(tmp / "rollouts" / "r-00000-of-00001.parquet", teacher,
                     [(5, 7), (9, 1), (40, MAX_LEN - 40)] + [(6, 20)] * 12)
    srv = server.use(teacher)
    t = time.perf_counter()
    assert main(["--rollouts", str(tmp / "rollouts"), "--cache", str(tmp / "served"), "--teacher", str(teacher),
                 "--teacher-url", srv.url, "--teacher-model", NAME, "--teacher-api-key-env", KEY_ENV,
                 "--topk", str(K), f"max_model_len={MAX_LEN}",
                 "part_rows=4", "batch_tokens=256", "codec=exact-f32"]) == 0
    return {"tmp": tmp, "rows": rows, "seconds": time.perf_counter() - t}


def test_served_cache_equals_in_process_scoring(scored, teacher):
    tmp = scored["tmp"]
    score(_cfg(tmp, teacher, cache=str(tmp / "local"), enforce_eager=True, kv_cache_gib=0.05))
    served = {s.sample_id: s for s in read_cache(tmp / "served")}
    local = {s.sample_id: s for s in read_cache(tmp / "local")}
    assert served.keys() == local.keys() and len(served) == len(scored["rows"])
    worst = 0.0
    for sid, s in served.items():
        ref = local[sid]
        np.testing.assert_array_equal(s.input_ids, ref.input_ids)
        assert s.first_scored == ref.first_scored
        np.testing.assert_array_equal(s.topk_ids, ref.topk_ids)
        np.testing.assert_array_equal(s.actual_ranks, ref.actual_ranks)
        for name in ("topk_logprobs", "actual_logprobs", "tail_logprobs"):
            worst = max(worst, float(np.abs(getattr(s, name) - getattr(ref, name)).max()))
    print(f"\n[served] max |served - in-process| logprob {worst:.3g} nat; served scoring {scored['seconds']:.1f} s")
    assert worst <= TOLERANCE
    d = TeacherCache.open(tmp / "served").descriptor
    assert d.teacher.startswith(f"served {NAME} at https://127.0.0.1:") and d.teacher_probe["model"] == NAME
    assert d.teacher_fingerprint != TeacherCache.open(tmp / "local").descriptor.teacher_fingerprint
    assert TeacherCache.open(tmp / "served").verify() == []


def _traces_of_the_key(root: Path, *texts: str) -> list[str]:
    """Every file under `root` and every text that holds KEY (raw bytes: Parquet, JSON, logs, scripts alike)."""
    hits = [str(p) for p in sorted(root.rglob("*")) if p.is_file() and KEY.encode() in p.read_bytes()]
    return hits + [f"output {i}" for i, t in enumerate(texts) if KEY in t]


def test_the_key_is_sent_as_a_bearer_token_and_never_written_or_printed(tmp_path, teacher, server, capfd, monkeypatch):
    """401s name the variable to set; a run with the key from the default variable (OPENAI_API_KEY), with every
    log on (GKD_LOG_LEVEL=debug, the openai client's and its HTTP library's loggers at DEBUG, as OPENAI_LOG=debug
    sets them), and a `gkd slurm score --dry-run` script of the same command leave no trace of the key in any file
    or in anything printed."""
    from pipeline.cli import main as gkd

    srv = server.use(teacher)
    _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", teacher, [(5, 9)] * 3, seed=5)
    args = ["--rollouts", str(tmp_path / "rollouts"), "--teacher", str(teacher), "--teacher-url", srv.url,
            "--teacher-model", NAME, "--topk", str(K), f"max_model_len={MAX_LEN}", "codec=exact-f32"]
    outputs = []

    monkeypatch.setenv("WRONG_KEY", "sk-not-the-key")
    assert gkd(["score", *args, "--cache", str(tmp_path / "c-wrong"), "--teacher-api-key-env", "WRONG_KEY"]) == 2
    out = capfd.readouterr()
    outputs += [out.out, out.err]
    assert "HTTP 401" in out.err and "the key in WRONG_KEY is not one it accepts" in out.err, out.err
    assert "export WRONG_KEY with the key the server was started with" in out.err
    monkeypatch.delenv(KEY_ENV)
    assert gkd(["score", *args, "--cache", str(tmp_path / "c-none")]) == 2
    out = capfd.readouterr()
    outputs += [out.out, out.err]
    assert "no key was sent: OPENAI_API_KEY or VLLM_API_KEY is not set" in out.err, out.err
    assert "export OPENAI_API_KEY (or VLLM_API_KEY)" in out.err and "Traceback" not in out.err
    assert gkd(["score", *args, "--cache", str(tmp_path / "c-unset"), "--teacher-api-key-env", KEY_ENV]) == 2
    out = capfd.readouterr()
    outputs += [out.out, out.err]
    assert f"the environment variable {KEY_ENV} is not set" in out.err, out.err
    assert not any((tmp_path / c).exists() for c in ("c-wrong", "c-none", "c-unset"))  # refused before the cache

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("GKD_LOG_LEVEL", "debug")
    handler = logging.StreamHandler(sys.stderr)
    loggers = [logging.getLogger(n) for n in ("openai", "httpx2", "httpcore2", "httpx", "httpcore")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    try:
        assert gkd(["score", *args, "--cache", str(tmp_path / "cache")]) == 0
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
            lg.removeHandler(handler)
    assert gkd(["slurm", "score", "--num-shards", "2", "--dry-run", "--log-dir", str(tmp_path / "slurm"), "--",
                *args, "--cache", str(tmp_path / "cache")]) == 0
    out = capfd.readouterr()
    outputs += [out.out, out.err]
    assert "HTTP Request: POST" in out.err or "Request options" in out.err, "the debug logs did not run"
    assert len(list(read_cache(tmp_path / "cache"))) == 3 and list((tmp_path / "slurm").glob("*.sbatch"))
    assert _traces_of_the_key(tmp_path, *outputs) == []
    (tmp_path / "planted.txt").write_text(f"x{KEY}y")  # the scan itself finds a key where there is one
    assert _traces_of_the_key(tmp_path) == [str(tmp_path / "planted.txt")]


@pytest.mark.slow  # CI: a killed scorer's resume (test_score.py) and the served cache's equality (above)
def test_server_killed_mid_run_then_restarted_rerun_completes_without_duplicates(tmp_path, teacher, server, monkeypatch):
    rows = _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", teacher, [(6, 20)] * 40, seed=2)
    srv = server.use(teacher)
    # one request at a time, two rows per part: the kill lands after a few parts, long before the end
    cfg = _cfg(tmp_path, teacher, part_rows=2, **_served(srv, served_concurrency=1, served_inflight_tokens=32,
                                                          served_retries=1))
    failure: list[BaseException] = []
    # A pause the test controls: the scorer's first commit lands, then its writer waits until the server is down
    # (a poll for the first part raced the scorer on a loaded machine, in both directions)
    landed, go, commit = threading.Event(), threading.Event(), TeacherCache.add_rows

    def add_rows(self, *args, **kwargs):
        out = commit(self, *args, **kwargs)
        if not landed.is_set():
            landed.set()
            assert go.wait(600)
        return out

    def run():
        try:
            score(cfg)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            failure.append(e)

    monkeypatch.setattr(TeacherCache, "add_rows", add_rows)
    worker = threading.Thread(target=run)
    worker.start()
    assert landed.wait(600), failure  # the first part is in the cache
    srv.stop()  # SIGTERM to the whole process group while requests are in flight
    go.set()
    worker.join(600)
    assert not worker.is_alive()
    monkeypatch.undo()
    assert failure and isinstance(failure[0], ServedTeacherError), failure
    assert "no answer after 2 attempts" in str(failure[0]) and "Rerun when it is" in str(failure[0])
    done_before = len(TeacherCache.open(tmp_path / "cache").keys())
    assert 0 < done_before < len(rows) and not list((tmp_path / "cache" / "tasks").glob("*.done"))

    server.use(teacher)  # restarted: same URL, same model
    summary = score(cfg)
    assert summary["skipped"]["cached"] == done_before and summary["scored"] == len(rows) - done_before
    cache = TeacherCache.open(tmp_path / "cache")
    assert cache.verify() == []  # duplicate keys would be listed here
    keys = [s.key for s in cache.iter_samples()]
    assert len(keys) == len(set(keys)) == len(rows)


def test_another_model_behind_the_same_url_is_refused_before_the_cache_is_touched(scored, teacher, other_teacher,
                                                                                  server):
    tmp = scored["tmp"]
    cache = tmp / "served"
    recorded = TeacherCache.open(cache).descriptor.teacher_fingerprint
    before = _snapshot(cache)
    srv = server.use(other_teacher, max_logprobs=4)  # same port and name, another model (also serves test 4)
    _rollouts(tmp / "more" / "r-00000-of-00001.parquet", teacher, [(4, 6)] * 2, seed=3)  # new rows to score
    with pytest.raises(CacheMismatchError) as e:
        score(_cfg(tmp, teacher, rollouts=str(tmp / "more"), cache=str(cache), topk=4, **_served(srv)))
    message = str(e.value)
    assert "the served teacher is not the one this cache was scored with" in message
    assert f"Cache's teacher fingerprint {recorded}" in message and "the server's " in message
    assert "probe sequence differ from the cache's by up to" in message
    assert _snapshot(cache) == before


def test_a_4xx_names_the_servers_message_and_the_fix(tmp_path, teacher, other_teacher, server):
    srv = server.use(other_teacher, max_logprobs=4)
    _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", teacher, [(4, 6)], seed=4)
    with pytest.raises(ServedTeacherError, match=r"HTTP 400\): Requested prompt logprobs of 8, which is greater than "
                       r"max allowed: 4.*restart the server with --max-logprobs >= 8"):
        score(_cfg(tmp_path, teacher, **_served(srv)))
    with pytest.raises(ServedTeacherError, match=r"serves \['tiny'\], not 'nope'"):
        score(_cfg(tmp_path, teacher, topk=4, **_served(srv, teacher_model="nope")))
    assert not (tmp_path / "cache").exists()
    # the CLI prints the same message, no traceback
    from pipeline.score.run import main

    assert main(["--rollouts", str(tmp_path / "rollouts"), "--cache", str(tmp_path / "cache"), "--teacher",
                 str(teacher), "--teacher-url", srv.url, "--teacher-api-key-env", KEY_ENV, "--topk", "8",
                 f"max_model_len={MAX_LEN}"]) == 2
