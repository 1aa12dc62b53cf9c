"""Reaching a served teacher safely: the --teacher-url check (no credentials in it: `url_problems`), the API key
from the environment (`api_key_from_env`), the CA bundle for https:// (`ssl_context`), and the error the served
teacher raises (`ServedTeacherError`). The key is sent as a bearer token (read from the variable
--teacher-api-key-env names, else OPENAI_API_KEY, else VLLM_API_KEY; never from the URL, which is refused when it
holds one); https:// works with the system's CAs or the bundle SSL_CERT_FILE names."""

from __future__ import annotations

import os
import ssl
import urllib.parse
from pathlib import Path

from pipeline.errors import UserError

# Where the bearer key is read from when --teacher-api-key-env is not given: the openai client's variable, then
# vLLM's own (the server reads VLLM_API_KEY as its --api-key).
API_KEY_ENVS = ("OPENAI_API_KEY", "VLLM_API_KEY")
NO_KEY = "EMPTY"  # sent when no key is set (what vLLM's examples pass); a server without --api-key ignores it
CA_BUNDLE_ENV = "SSL_CERT_FILE"
SECRET_WORDS = ("key", "token", "secret", "password", "auth", "sig")  # query parameters refused in a teacher_url


class ServedTeacherError(UserError, RuntimeError):
    """The server refused a request or stayed unreachable: the message names the URL, the server's words, the fix."""


def api_key_from_env(env: str | None) -> tuple[str | None, str]:
    """The bearer key for the server and the name of the variable it came from (the key itself is never in a
    config, a command line, a file or a message: only its variable's name is). `env` names the variable
    (--teacher-api-key-env); without it OPENAI_API_KEY, then VLLM_API_KEY, as the openai client and vLLM read
    them. A named variable that is unset or empty is refused: the user meant to send a key."""
    for name in [env] if env else API_KEY_ENVS:
        value = os.environ.get(name, "")
        if value:
            return value, name
    if env:
        raise ServedTeacherError(f"--teacher-api-key-env {env}: the environment variable {env} is not set (or is "
                                 f"empty); export {env} with the key the server was started with (--api-key)")
    return None, " or ".join(API_KEY_ENVS)


def url_problems(url: str) -> list[str]:
    """What is wrong with a --teacher-url, as config problems. A key inside the URL (https://KEY@host,
    https://user:KEY@host, ?api_key=KEY) would be written wherever the URL is (cache.json, logs, sbatch scripts):
    refused, and the message shows the URL with that part replaced, never the part itself."""
    if not str(url).startswith(("http://", "https://")):
        return [f"teacher_url must be an http(s) URL like http://HOST:PORT/v1, got {_redacted(url)!r}"]
    parts = urllib.parse.urlsplit(str(url))
    secret_query = [k for k, _ in urllib.parse.parse_qsl(parts.query) if any(w in k.lower() for w in SECRET_WORDS)]
    if parts.username is not None or parts.password is not None or secret_query:
        where = "user/password part (KEY@)" if parts.username is not None else f"query ({', '.join(secret_query)})"
        return [f"teacher_url holds credentials in its {where}: {_redacted(url)!r}. The URL is written into "
                "cache.json, logs and Slurm scripts, so a key must not be in it: put the key in an environment "
                "variable and pass its name, --teacher-api-key-env VAR (default: OPENAI_API_KEY, then "
                "VLLM_API_KEY); it is sent as a bearer token"]
    return []


def _redacted(url: str) -> str:
    """`url` with any user/password part and query string replaced by '***' (safe to print)."""
    parts = urllib.parse.urlsplit(str(url))
    netloc = parts.netloc.rpartition("@")[2]
    netloc = ("***@" if "@" in parts.netloc else "") + netloc
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))


def ssl_context() -> ssl.SSLContext | bool:
    """Certificate checks for https:// URLs: the system's CAs, or the bundle SSL_CERT_FILE names (the variable
    OpenSSL, httpx and the openai client read), checked here so a wrong path is one clear message."""
    bundle = os.environ.get(CA_BUNDLE_ENV)
    if not bundle:
        return True
    if not Path(bundle).is_file():
        raise ServedTeacherError(f"{CA_BUNDLE_ENV}={bundle}: no such file; point {CA_BUNDLE_ENV} at the PEM bundle of "
                                 "the CA that signed the server's certificate, or unset it to use the system's CAs")
    try:
        return ssl.create_default_context(cafile=bundle)
    except ssl.SSLError as e:
        raise ServedTeacherError(f"{CA_BUNDLE_ENV}={bundle}: not a PEM certificate bundle ({e})") from None
