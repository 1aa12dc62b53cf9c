"""A served teacher: the score stage's engine behind a running vLLM OpenAI-compatible server (`ServedTeacher`).

    gkd score --teacher-url http://HOST:PORT/v1 --teacher-model NAME --teacher TOKENIZER_DIR --rollouts R --cache C --topk K

Only the engine changes: rows, alignment, parts, markers, resume and the progress bar are the score stage's own
(pipeline/score/scorer.py). Each rollout is one `/v1/completions` request with the token ids as `prompt`,
`max_tokens: 1` and `prompt_logprobs: K`; the answer's `prompt_logprobs` is turned into the flat layout of an
in-process engine (served/logprobs.py `flat_from_json`) and goes through the same `extract`
(docs/dependencies.md, "OpenAI-compatible server").

Rollouts with images go to vLLM's token-in endpoint instead, `POST /inference/v1/generate` (the server must run
with `--enable-scale-out`): `token_ids` are the rollout's ids with each image's placeholder run collapsed to one
token, as the in-process teacher sends them, `content_parts` the images as PNG data URLs of the pixels the
in-process teacher and the student decode (`image_store.load`, re-encoded losslessly, so the server's own decoding
of RGBA or EXIF-rotated files cannot differ), `sampling_params` asks for the prompt logprobs, and
`return_token_ids` returns the server's expansion of the placeholders, checked against the rollout's token for
token before its logprobs are read (`check_expansion`, the score stage's one rule). /v1/completions takes no images,
and /v1/chat/completions renders its own prompt from messages through the chat template, so neither can score the
rollout's exact ids with pixels (docs/dependencies.md, "OpenAI-compatible server").

Requests go through the `openai` client (what vLLM's own examples, TRL's and verl's server clients use): vLLM's
`prompt_logprobs` rides in `extra_body` and comes back among the answer's extra fields. The client sends the API
key as a bearer token (read from the variable --teacher-api-key-env names, else OPENAI_API_KEY, else VLLM_API_KEY:
served/access.py `api_key_from_env`; never from the URL, which is refused when it holds one: `url_problems`), pools
connections, times out (`served_timeout_s`) and retries 408/409/429/5xx and connection errors with its backoff
(0.5 s doubling to 8 s, jittered; `served_retries` times: the default 12 waits ~70 s, a restarting vLLM server).
https:// works with the system's CAs or the bundle SSL_CERT_FILE names (`ssl_context`). What the client does not
do is kept here: requests run on a thread pool bounded by the tokens in flight and are answered to the loop in
rollout order; a 4xx stops the run with the server's message and the server flag or variable that fixes it
(`_explain`).

Identity (`describe`): the served model name plus its logprobs of a fixed probe sequence (served/probe.py).
"""

from __future__ import annotations

import base64
import json
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai

from pipeline.score.served.access import (
    CA_BUNDLE_ENV,
    NO_KEY,
    ServedTeacherError,
    api_key_from_env,
    ssl_context,
    url_problems,
)
from pipeline.score.served.logprobs import FlatLogprobs, flat_from_json
from pipeline.score.served.probe import (
    PROBE_IMAGE,
    PROBE_QUANTUM,
    PROBE_TOLERANCE,
    png_bytes,
    probe_fingerprint,
    probe_ids,
    probe_image,
)
from pipeline.store import images as image_store

# What the openai client retries itself (408, 409, 429, >= 500); still failing after its retries: "no answer".
RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
# vLLM's token-in endpoint (at the server root, behind --api-key like /v1): token ids plus raw images
GENERATE_PATH = "/inference/v1/generate"
SCALE_OUT_FLAG = "--enable-scale-out"  # the server flag that mounts it (without it: HTTP 403 naming the flag)


class ServedTeacher:
    """The score loop's engine for a vLLM OpenAI-compatible server (`score_batches`), plus the checks done once
    before any scoring (`describe`: model, max_model_len, the prompt_logprobs answer, tokenizer and the probe).
    Requests go through the `openai` client: it sends the key as a bearer token, pools connections, times out
    and retries (408/409/429/5xx and connection errors, backoff 0.5 s doubling to 8 s with jitter)."""

    def __init__(self, url: str, model: str | None, k: int, *, inflight_tokens: int = 16384, concurrency: int = 16,
                 retries: int = 12, timeout_s: float = 600.0, api_key_env: str | None = None,
                 logprob_mode: str = "raw_logprobs", image_token: int | None = None, image_root: Path | None = None,
                 check_expansion: Callable[[dict, Sequence[int], int, str], None] | None = None) -> None:
        problems = url_problems(url)
        if problems:
            raise ServedTeacherError(problems[0])
        self.url = url.rstrip("/")
        self.model = model
        self.k = k
        self.inflight_tokens = inflight_tokens
        self.concurrency = concurrency
        self.retries = retries
        self.logprob_mode = logprob_mode
        # a vision-language teacher: its placeholder token, where the rollouts' images are, and the score stage's
        # check of the server's expansion against the rollout's (raises, naming the sample and both counts)
        self.image_token, self.image_root, self.check_expansion = image_token, image_root, check_expansion
        key, self.key_source = api_key_from_env(api_key_env)
        self.key_sent = key is not None
        self.key_env = api_key_env
        # the client's default pool (up to 1000 connections, 100 kept alive) holds every request in flight
        http = openai.DefaultHttpxClient(verify=ssl_context())
        # vLLM's convention for "no key" (its examples): the client insists on one, a server without --api-key
        # ignores it, and one with --api-key answers 401, which _explain turns into which variable to set.
        self.client = openai.OpenAI(base_url=self.url, api_key=key or NO_KEY, max_retries=retries,
                                    timeout=timeout_s, http_client=http)

    # -- HTTP ---------------------------------------------------------------------------------------------------
    def _root(self) -> str:
        """The server's root (where /version and /tokenize live): the URL without its trailing /v1."""
        return self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url

    def _call(self, where: str, fn):
        """fn() through the client; its errors (after its own retries) as one ServedTeacherError naming the URL,
        the server's words and the fix. `from None`: the client's exception carries the request, headers included."""
        try:
            return fn()
        except openai.APIStatusError as e:
            message = _server_message(e)
            if e.status_code not in RETRY_STATUS:
                raise ServedTeacherError(self._explain(where, e.status_code, message)) from None
            last = f"HTTP {e.status_code}: {message}"
        except openai.APIConnectionError as e:  # refused, reset, TLS, timeouts (APITimeoutError)
            cause = e.__cause__ or e
            if "CERTIFICATE_VERIFY_FAILED" in str(cause):
                raise ServedTeacherError(
                    f"{where}: the server's TLS certificate is not trusted ({cause}); export {CA_BUNDLE_ENV} naming "
                    "the PEM bundle of the CA that signed it") from None
            last = f"{type(e).__name__}: {cause}"
        raise ServedTeacherError(f"{where}: no answer after {self.retries + 1} attempts (last: {last}); is the server "
                                 "up? Rerun when it is: scored parts are kept and the rerun continues after them")

    def _get(self, path: str, *, root: bool = False) -> dict:
        url = (self._root() if root else self.url) + path
        return self._call(url, lambda: self.client.get(url, cast_to=object)) or {}

    def _post(self, path: str, body: dict, *, root: bool = False) -> dict:
        url = (self._root() if root else self.url) + path
        return self._call(url, lambda: self.client.post(url, body=body, cast_to=object)) or {}

    def _explain(self, url: str, code: int, message: str) -> str:
        fix = "check the request settings against the server's flags (docs/dependencies.md, 'OpenAI-compatible server')"
        if SCALE_OUT_FLAG in message:
            fix = (f"the images of a vision-language teacher's rollouts go to vLLM's token-in endpoint "
                   f"({GENERATE_PATH}), which the server mounts only with {SCALE_OUT_FLAG}: restart it with that flag")
        elif "may be provided in one prompt" in message:
            fix = ("restart the server with --limit-mm-per-prompt '{\"image\": N}', N the most images of a rollout "
                   "(or score with max_images_per_prompt at the server's limit to refuse larger rows before scoring)")
        elif code in (401, 403):
            var = self.key_env or "OPENAI_API_KEY (or VLLM_API_KEY)"
            sent = (f"the key in {self.key_source} is not one it accepts" if self.key_sent else
                    f"no key was sent: {self.key_source} is not set")
            fix = (f"the server wants an API key and {sent}; export {var} with the key the server was started with "
                   "(its --api-key / VLLM_API_KEY), or pass --teacher-api-key-env VAR naming the variable that holds it")
        elif "greater than max allowed" in message or "logprobs" in message.lower() and code == 400:
            fix = f"restart the server with --max-logprobs >= {self.k} (this run asks for --topk {self.k})"
        elif code == 404 or "does not exist" in message:
            fix = f"pass --teacher-model one of the names the server serves (GET {self.url}/models)"
        elif "out of vocabulary" in message:
            fix = "the server's model has a smaller vocabulary than these rollouts' ids: is it the right teacher?"
        elif "context length" in message or "max_tokens must be at least 1" in message:
            fix = "restart the server with a larger --max-model-len (one more than the longest sequence scored)"
        return f"{url}: the server refused the request (HTTP {code}): {message}; {fix}"

    # -- checks before scoring -------------------------------------------------------------------------------------
    def describe(self, vocab_size: int, tokenizer) -> dict:
        """Everything about the server the stage checks before it touches the cache: the model is served, its
        max_model_len, a K-prompt-logprob request passes and its answer holds prompt_logprobs (a server started
        with a smaller --max-logprobs refuses it here; an endpoint that is not vLLM lacks the field), its
        tokenizer agrees with the local one on a sample text, and the probe (fingerprint)."""
        models = self._get("/models").get("data", [])
        served = {m.get("id"): m for m in models}
        if self.model is None and len(served) == 1:
            self.model = next(iter(served))  # the fingerprint holds the name, so a renamed model is another teacher
        if self.model not in served:
            raise ServedTeacherError(f"{self.url}: serves {sorted(served)}, not {self.model!r}; pass --teacher-model "
                                     f"one of them (or start the server with --served-model-name {self.model})")
        ids = probe_ids(vocab_size)
        out = self._complete(ids)
        flat = flat_from_json(out, np.asarray(ids), self.k)
        logprobs = [float(v) for v in flat.logprobs[flat.start_indices[1:]]]  # the actual tokens' (entry 0)
        image = None
        if self.image_token is not None:  # the probe ids again with the probe image in the middle
            half = len(ids) // 2
            image_ids = [t for t in ids[:half] if t != self.image_token] + [self.image_token] + \
                [t for t in ids[half:] if t != self.image_token]
            out, expanded = self._generate(image_ids, [probe_image()])
            flat = flat_from_json(out, np.asarray(expanded), self.k)
            logprobs += [float(v) for v in flat.logprobs[flat.start_indices[1:]]]
            image = PROBE_IMAGE
        text = "The quick brown fox: 12 + 7 = 19."
        local = tokenizer(text, add_special_tokens=False)["input_ids"]
        remote = self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False},
                            root=True).get("tokens")
        if list(remote or []) != list(local):
            raise ServedTeacherError(f"{self.url}: the server tokenizes {text!r} as {remote}, the local teacher "
                                     f"tokenizer as {local}: the served model's tokenizer is another one; pass "
                                     "--teacher the folder of the served model's tokenizer")
        try:
            version = self._get("/version", root=True).get("version", "?")
        except ServedTeacherError:
            version = "?"
        probe = {"model": self.model, "ids": json.dumps(ids), "logprobs": json.dumps(logprobs),
                 "quantum": str(PROBE_QUANTUM), "tolerance": str(PROBE_TOLERANCE)}
        if image is not None:
            probe["image"] = image
        return {"max_model_len": served[self.model].get("max_model_len"), "version": version, "probe": probe,
                "fingerprint": probe_fingerprint(self.model, ids, logprobs, image)}

    def _complete(self, ids: list[int]) -> list:
        """One rollout's prompt logprobs: a completion of max_tokens 1 with vLLM's `prompt_logprobs` request field
        (not in the OpenAI API: `extra_body`) and read back from the answer's extra fields (`model_extra`)."""
        answer = self._call(f"{self.url}/completions", lambda: self.client.completions.create(
            model=self.model, prompt=ids, max_tokens=1, temperature=0.0, extra_body={"prompt_logprobs": self.k}))
        choice = answer.choices[0] if answer.choices else None
        out = None if choice is None else (choice.model_extra or {}).get("prompt_logprobs")
        if out is None:
            raise ServedTeacherError(
                f"{self.url}/completions: the answer's choices[0] holds no 'prompt_logprobs' field, which scoring "
                "needs (vLLM's extension of the completions API): is this a vLLM server? Serve the teacher with "
                "`python -m vllm.entrypoints.openai.api_server` (README, 'A served teacher')")
        return out

    def _generate(self, ids: list[int], images: list[bytes]) -> tuple[list, list[int]]:
        """One prompt with images through vLLM's token-in endpoint: `ids` with one placeholder token per image (vLLM
        expands each with the teacher's processor, as in process), the images as PNG data URLs. Returns the
        answer's prompt_logprobs and the server's expanded prompt ids."""
        body = {"model": self.model, "token_ids": list(ids), "return_token_ids": True,
                "content_parts": [{"type": "image_url",
                                   "url": "data:image/png;base64," + base64.b64encode(data).decode("ascii")}
                                  for data in images],
                "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": self.k,
                                    "detokenize": False}}
        answer = self._post(GENERATE_PATH, body, root=True)
        out, expanded = answer.get("prompt_logprobs"), answer.get("prompt_token_ids")
        if out is None or expanded is None:
            raise ServedTeacherError(
                f"{self._root()}{GENERATE_PATH}: the answer holds no 'prompt_logprobs'/'prompt_token_ids', which "
                "scoring images needs (vLLM's token-in endpoint): serve the teacher with vLLM "
                f"`python -m vllm.entrypoints.openai.api_server ... {SCALE_OUT_FLAG}` (README, 'A served teacher')")
        return out, [int(t) for t in expanded]

    def _score_row(self, row: dict) -> FlatLogprobs:
        """One rollout's flat prompt logprobs: text through /v1/completions, images through the token-in endpoint
        (the server's expansion checked against the rollout's before its logprobs are read)."""
        ids = np.asarray(row["engine_ids"], np.int64)
        if not row.get("images"):
            return flat_from_json(self._complete(ids.tolist()), ids, self.k)
        pixels = image_store.load(self.image_root, row["images"], sample=row["sample_id"])
        out, expanded = self._generate(image_store.collapse(ids, self.image_token), [png_bytes(p) for p in pixels])
        self.check_expansion(row, expanded, self.image_token, "server")
        return flat_from_json(out, ids, self.k)

    # -- the engine the score loop drives --------------------------------------------------------------------------
    def score_batches(self, batches: Iterable[list[dict]]) -> Iterator[tuple[list[dict], list[FlatLogprobs]]]:
        """Yield each batch with its rows' flat prompt logprobs, in order, while up to `inflight_tokens` tokens of
        later rows are already at the server (one request per row, so the server's scheduler batches them as it
        sees fit and a retry repeats one row only)."""
        cond = threading.Condition()
        inflight = [0]

        def one(row: dict) -> FlatLogprobs:
            try:
                return self._score_row(row)
            finally:
                with cond:
                    inflight[0] -= len(row["engine_ids"])
                    cond.notify_all()

        queue: deque[tuple[list[dict], list[Future]]] = deque()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="gkd-served")
        try:
            for batch in batches:
                futures = []
                for r in batch:
                    ids = np.asarray(r["engine_ids"], np.int64)
                    with cond:  # a row longer than the bound goes alone
                        cond.wait_for(lambda n=len(ids): inflight[0] == 0 or inflight[0] + n <= self.inflight_tokens)
                        inflight[0] += len(ids)
                    futures.append(pool.submit(one, r))
                    while queue and all(f.done() for f in queue[0][1]):
                        done, fs = queue.popleft()
                        yield done, [f.result() for f in fs]
                queue.append((batch, futures))
            while queue:
                done, fs = queue.popleft()
                yield done, [f.result() for f in fs]
        finally:
            # a failed or abandoned run: requests not started are dropped; those at the server end after at most
            # the client's own retries (served_retries)
            pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        self.client.close()


def _server_message(e: openai.APIStatusError) -> str:
    """The `error.message` of a vLLM error answer (the client has already unwrapped `error`), else its body."""
    body = e.body
    if isinstance(body, dict):
        return str(body.get("message", body))
    if body:
        return str(body)[:500]
    try:
        return e.response.text.strip()[:500] or e.message
    except Exception:  # noqa: BLE001 - a body that cannot be read: the client's own message
        return e.message
