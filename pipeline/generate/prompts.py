"""Prompt sources for the generate stage, and the one place that turns chat messages into token ids.

Sources (`load_prompts(src, ...)`):
- a local JSONL / JSON / Parquet file or a `datasets.save_to_disk` folder, read with `datasets`; a text field
  (`prompt_field`, sent as one user message) or a chat field (`messages_field`, a list of {role, content});
- `reasoning-gym:TASK[,TASK...]?size=N&seed=S`: N seeded, offline problems per task; the question is the user
  message and the reference answer is kept (the import path uses it as the response).

Token ids come from the tokenizer's chat template exactly once (`prompt_ids`): the ids go to vLLM as a
`TokensPrompt`, so neither a second tokenisation of the rendered text nor vLLM adds another BOS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from pipeline.errors import UserError
from pipeline.store.images import collapse, image_hash, image_token_id
from pipeline.store.images import put as put_image

RG_PREFIX = "reasoning-gym:"


class PromptError(UserError, ValueError):
    """A prompt source is unreadable or lacks a field; the message names the field and the file."""


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    messages: list[dict]  # chat turns ending with the user turn the model answers
    response: str | None = None  # reference response (dataset) or answer (reasoning-gym); None when absent
    tags: dict[str, str] = field(default_factory=dict)
    # Privileged-context teacher (OPSD): the chat the teacher sees instead of `messages` (e.g. the question with
    # its reference solution); None = the teacher sees `messages`; [] = the row's field is empty (a bad row).
    teacher_messages: list[dict] | None = None
    # The prompt's images (their bytes), in the order of their placeholders: one `{"type": "image"}` item each at the
    # start of the last user turn's content (`with_images`)
    images: tuple[bytes, ...] = ()
    # Where each image came from (its path as resolved, or "embedded bytes"), for messages that name it
    image_names: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        # The turn the model answers is the last one; a system prompt alone is not a prompt.
        if not self.messages:
            return True
        content = self.messages[-1].get("content")
        if isinstance(content, list):
            return not any(str(c.get("text") or "").strip() for c in content) and not self.images
        return not str(content or "").strip() and not self.images


def load_prompts(
    src: str,
    *,
    prompt_field: str = "prompt",
    messages_field: str | None = None,
    response_field: str | None = None,
    id_field: str | None = None,
    teacher_prompt_field: str | None = None,
    tag_fields: Sequence[str] = (),
    image_field: str | None = None,
) -> list[Prompt]:
    """All prompts of a source, in source order (ids are stable: the `id_field` value or the row index).
    `teacher_prompt_field`: a text (one user message) or chat field the teacher sees instead of the prompt (OPSD).
    `tag_fields`: fields copied into each prompt's tags as strings (what score --tags and the trainer route on).
    `image_field`: the prompt's images: a path (relative to the dataset file's folder) or embedded bytes (a
    `datasets.Image` value, `{"bytes": ..., "path": ...}`), or a list of them; read here, so a missing file is
    refused before anything is written."""
    if src.startswith(RG_PREFIX):
        if teacher_prompt_field or tag_fields:
            raise PromptError(f"{src}: teacher_prompt_field / tag_fields need a dataset file with those fields "
                              "(reasoning-gym prompts have none; they are tagged data_source=reasoning-gym:TASK)")
        return _reasoning_gym(src)
    rows, where = _read_dataset(src)
    columns = set(rows.column_names)
    needed = [f for f in (messages_field or prompt_field, response_field, id_field, teacher_prompt_field, image_field,
                          *tag_fields) if f]
    missing = [f for f in needed if f not in columns]
    if missing:
        raise PromptError(
            f"{where}: no field {', '.join(map(repr, missing))} (fields: {', '.join(sorted(columns))}); "
            "choose one with prompt_field= / messages_field= / response_field= / id_field= / teacher_prompt_field= / "
            "tag_fields= / image_field= (gkd generate) or --prompt-field / --messages-field / --response-field / "
            "--id-field / --teacher-prompt-field / --tag-field / --image-field (gkd import)"
        )
    if image_field:
        import datasets

        if isinstance(rows.features.get(image_field), datasets.Image):
            rows = rows.cast_column(image_field, datasets.Image(decode=False))  # the stored bytes, not decoded
        elif isinstance(getattr(rows.features.get(image_field), "feature", None), datasets.Image):
            rows = rows.cast_column(image_field, datasets.Sequence(datasets.Image(decode=False)))
    data_source = Path(src).name
    prompts = []
    for i, row in enumerate(rows):
        if messages_field:
            messages = [{"role": m["role"], "content": m["content"]} for m in (row[messages_field] or [])]
        else:
            messages = [{"role": "user", "content": row[prompt_field] or ""}]
        response = row[response_field] if response_field else None
        # A conversation that already ends with the assistant's turn: that turn is the reference response.
        if messages and messages[-1]["role"] == "assistant":
            last = messages.pop()
            response = last["content"] if response is None else response
        pid = str(row[id_field]) if id_field else str(i)
        teacher = _teacher_messages(row[teacher_prompt_field]) if teacher_prompt_field else None
        tags = {"data_source": data_source, **{f: "" if row[f] is None else str(row[f]) for f in tag_fields}}
        named = _image_bytes(row[image_field], Path(src), pid, image_field) if image_field else ()
        images, names = tuple(b for b, _ in named), tuple(n for _, n in named)
        if images:
            messages = with_images(messages, len(images))
        prompts.append(Prompt(pid, messages, response, tags, teacher, images, names))
    return prompts


def with_images(messages: list[dict], count: int) -> list[dict]:
    """The chat with `count` image items at the start of the last turn (the content-list form chat templates of
    vision-language models render as one placeholder each)."""
    last = dict(messages[-1])
    text = last.get("content")
    items = text if isinstance(text, list) else [{"type": "text", "text": str(text or "")}]
    last["content"] = [{"type": "image"} for _ in range(count)] + items
    return [*messages[:-1], last]


def image_name(prompt: Prompt, i: int) -> str:
    """Where image i of a prompt came from (its file, or embedded bytes), for a message that names it."""
    return prompt.image_names[i] if i < len(prompt.image_names) else "embedded bytes"


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _image_bytes(value, src: Path, pid: str, field: str) -> tuple[tuple[bytes, str], ...]:
    """A row's image field -> (bytes, where they came from) of its images (paths resolved against the dataset
    file's folder; a URL is refused, not fetched)."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    base = src.parent if src.is_file() else src
    out = []
    for v in values:
        if isinstance(v, dict) and v.get("bytes"):
            out.append((bytes(v["bytes"]), f"embedded bytes of {v['path']}" if v.get("path") else "embedded bytes"))
            continue
        name = v.get("path") if isinstance(v, dict) else v
        if not isinstance(name, str) or not name:
            raise PromptError(f"{src}: row {pid!r}: field {field!r} holds {type(v).__name__} {str(v)[:60]!r}, not an "
                              "image path or embedded bytes ({'bytes': ...}); fix the row")
        if _URL.match(name):
            raise PromptError(f"{src}: row {pid!r}: field {field!r} holds the URL {name!r}; URLs are not fetched: "
                              "download the images and give their paths (relative to the dataset file's folder)")
        path = Path(name) if Path(name).is_absolute() else base / name
        try:
            out.append((path.read_bytes(), str(path)))
        except OSError as e:
            raise PromptError(f"{src}: row {pid!r}: image {path} (field {field!r}) cannot be read ({e.strerror}); "
                              "paths are relative to the dataset file's folder: fix the path or add the file") from None
    return tuple(out)


def image_prompt_ids(processor, tokenizer, messages: Sequence[dict], images: Sequence) -> list[int]:
    """A prompt with images as the student sees it: the chat template with one placeholder per image, each expanded
    by the model's processor to the image's tokens. Collapsing the runs again must give the tokenizer's own prompt
    ids (`prompt_ids`), which the completion is aligned to; a processor whose template differs is refused."""
    text = processor.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    ids = [int(t) for t in processor(text=[text], images=list(images))["input_ids"][0]]
    plain = prompt_ids(tokenizer, messages)
    token = processor.image_token_id if hasattr(processor, "image_token_id") else tokenizer.convert_tokens_to_ids(
        processor.image_token)
    if collapse(ids, token) != collapse(plain, token):
        raise PromptError(f"the processor's chat template renders this prompt other than the tokenizer's "
                          f"({len(ids)} tokens with the images expanded, {len(plain)} without); give both one template")
    return ids


def store_images(out: Path, prompts: list[Prompt], rows: list[dict]) -> None:
    """The images the rows name, into OUT/images/ (each once, atomically), before the shard that names them: a
    refused row never leaves an image behind, and a shard never names an image that is not there."""
    named = {h for r in rows for h in (r.get("images") or ())}
    for p in prompts:
        for data in p.images:
            if image_hash(data) in named:
                put_image(out, data)


def _teacher_messages(value) -> list[dict]:
    """A teacher-prompt field: text -> one user message; a chat -> its turns; empty -> []."""
    if isinstance(value, list):
        turns = [{"role": m["role"], "content": m["content"]} for m in value]
        return turns if turns and str(turns[-1]["content"] or "").strip() else []
    return [{"role": "user", "content": str(value)}] if value is not None and str(value).strip() else []


def _read_dataset(src: str):
    import datasets

    path = Path(src)
    if not path.exists():
        raise PromptError(f"{src}: prompt source not found (a JSONL/Parquet file, a save_to_disk folder, "
                          f"or {RG_PREFIX}TASK?size=N&seed=S)")
    datasets.disable_progress_bars()
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if len(ds) != 1 and "train" not in ds:
                raise PromptError(f"{src}: a DatasetDict with splits {list(ds)}; point at one split's folder")
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return ds, src
    suffix = path.suffix.lower()
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix)
    if builder is None:
        raise PromptError(f"{src}: unknown prompt file type {suffix!r} (use .jsonl, .json, .parquet or a folder)")
    if suffix == ".jsonl":
        check_jsonl(path)
    return datasets.load_dataset(builder, data_files=str(path), split="train"), src


def check_jsonl(path: Path) -> None:
    """Every line of a JSONL file is UTF-8 and one JSON object; else PromptError with the line number (the JSON
    reader of `datasets` reports neither the line nor, for bad bytes, the file)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                # A byte-order mark (as Windows tools write UTF-8) is read past on the first line, as `datasets` does
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise PromptError(f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                  "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); fix or remove "
                                  "that line (JSONL: one JSON object per line)") from None
            if not isinstance(row, dict):
                raise PromptError(f"{path}:{lineno}: a JSON {type(row).__name__}, not an object; each line must be "
                                  '{"field": value, ...}')


def _reasoning_gym(src: str) -> list[Prompt]:
    import reasoning_gym

    spec, _, query = src[len(RG_PREFIX):].partition("?")
    params = {k: v[-1] for k, v in parse_qs(query).items()}
    unknown = set(params) - {"size", "seed"}
    if unknown or not spec:
        raise PromptError(f"{src}: expected {RG_PREFIX}TASK[,TASK...]?size=N&seed=S (unknown: {sorted(unknown)})")
    size, seed = int(params.get("size", 100)), int(params.get("seed", 0))
    prompts = []
    for task in spec.split(","):
        try:
            ds = reasoning_gym.create_dataset(task, size=size, seed=seed)
        except (KeyError, ValueError) as e:
            raise PromptError(f"{src}: reasoning-gym task {task!r}: {e}") from e
        for i, item in enumerate(ds):
            prompts.append(Prompt(
                f"rg:{task}:{seed}:{i}",
                [{"role": "user", "content": item["question"]}],
                str(item["answer"]),
                {"data_source": f"reasoning-gym:{task}", "answer": str(item["answer"])},
            ))
    return prompts


def prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """The chat template, tokenised once, ending with the assistant header the model continues from."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]


def response_ids(tokenizer, messages: Sequence[dict], response: str, prompt: Sequence[int]) -> list[int]:
    """Token ids of an assistant `response`, exactly as the chat template renders it after `prompt`.

    The whole conversation is tokenised and the prompt's ids must be its prefix (a template that renders the
    prompt differently once an answer follows would otherwise give misaligned ids). Tokens after the last EOS
    (the template's trailing newline) are dropped: a sampler stops at EOS and never produces them.
    """
    full = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": response}], tokenize=True, return_dict=False
    )
    full = [int(t) for t in full]
    if full[: len(prompt)] != list(prompt):
        raise PromptError(
            "the chat template renders the prompt differently when a response follows; cannot split prompt and "
            f"completion ids (prompt {list(prompt)[-8:]} vs conversation {full[len(prompt) - 8:len(prompt)]})"
        )
    completion = full[len(prompt):]
    eos = tokenizer.eos_token_id
    if eos is not None and eos in completion:
        completion = completion[: len(completion) - completion[::-1].index(eos)]
    return completion


def vision_processor(model_dir: str | Path, refusal: UserError) -> Any:
    """The processor of a vision-language model folder (what expands an image into its placeholder tokens);
    `refusal`, the caller's message naming its own option, is raised for a text-only model (a config.json without
    vision_config / image_token_id, or none)."""
    from transformers import AutoProcessor

    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if image_token_id(config) is None:
        raise refusal
    return AutoProcessor.from_pretrained(str(model_dir))
