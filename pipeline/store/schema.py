"""Versioned on-disk schemas, read from the data files in `schemas/`.

The JSON files are the single source of truth: the Arrow schemas the writers use and the checks the readers run
are both built from them. A file records `kind/version` in its Parquet key-value metadata; a reader refuses an
unknown *major* version (a minor bump only adds nullable fields, which old readers can ignore). A field with a
`since` version may be absent from files of an older minor version: readers take it as null, and writers fill it
with nulls when the rows do not carry it. A `sparse` field (scored 1.3's cross-tokenizer columns) is instead left
out where the rows do not carry it, and the file is tagged with the newest version among the fields it does hold
(`Schema.written`): files without it stay byte for byte what the older minor version wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pyarrow as pa

from pipeline.errors import UserError

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"
META_KEY = b"gkd.schema"  # Parquet key-value metadata entry: b"scored/1.0"


class SchemaError(UserError, ValueError):
    """A file does not follow the schema this code reads (unknown version, missing field, wrong type)."""


_TYPES = {
    "string": pa.string(),
    "binary": pa.binary(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "list<int32>": pa.list_(pa.int32()),
    "list<string>": pa.list_(pa.string()),
    "list<float32>": pa.list_(pa.float32()),
    "map<string,string>": pa.map_(pa.string(), pa.string()),
    "list<map<string,string>>": pa.list_(pa.map_(pa.string(), pa.string())),
}


@dataclass(frozen=True)
class Schema:
    kind: str
    version: str
    fields: tuple[dict, ...]

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def tag(self) -> bytes:
        return f"{self.kind}/{self.version}".encode()

    @property
    def arrow(self) -> pa.Schema:
        """The Arrow schema, with the kind/version tag in its metadata (it lands in the Parquet footer)."""
        return pa.schema(
            [pa.field(f["name"], _TYPES[f["type"]], nullable=f.get("nullable", False)) for f in self.fields],
            metadata={META_KEY: self.tag},
        )

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.fields]

    @property
    def sparse(self) -> set[str]:
        """Fields written only where set: a file without them is tagged with the older minor version."""
        return {f["name"] for f in self.fields if f.get("sparse")}

    def written(self, names: set[str] | list[str]) -> Schema:
        """The schema of a file holding these of the sparse fields (all others always): the sparse fields left out
        and the version the newest field it holds came with (the schema's own when every sparse field is there)."""
        leave = self.sparse - set(names)
        if not leave:
            return self
        fields = tuple(f for f in self.fields if f["name"] not in leave)
        versions = [f"{self.major}.0"] + [f["since"] for f in fields if "since" in f]
        version = max(versions, key=lambda v: tuple(int(x) for x in v.split(".")))
        return Schema(kind=self.kind, version=version, fields=fields)

    @property
    def optional(self) -> set[str]:
        """Fields added by a minor version (`since`): files of an older minor version lack them."""
        return {f["name"] for f in self.fields if "since" in f}


@cache
def load_schema(kind: str) -> Schema:
    """Load `schemas/<kind>.json` (kinds: rollout, scored, descriptor)."""
    path = SCHEMA_DIR / f"{kind}.json"
    data = json.loads(path.read_text())
    if data.get("kind") != kind:
        raise SchemaError(f"{path}: declares kind {data.get('kind')!r}, expected {kind!r}")
    for f in data["fields"]:
        if f["type"] not in _TYPES:
            raise SchemaError(f"{path}: field {f['name']!r} has unknown type {f['type']!r}")
    return Schema(kind=kind, version=str(data["version"]), fields=tuple(data["fields"]))


def check_tag(tag: bytes | str | None, kind: str, where: str | Path) -> None:
    """Refuse a file whose schema tag is missing, of another kind, or of an unknown major version."""
    expected = load_schema(kind)
    if tag is None:
        raise SchemaError(f"{where}: no {META_KEY.decode()} metadata; not a {kind} shard written by this pipeline")
    text = tag.decode() if isinstance(tag, bytes) else tag
    found_kind, _, found_version = text.partition("/")
    if found_kind != kind:
        raise SchemaError(f"{where}: is a {found_kind!r} file, expected a {kind!r} file")
    try:
        major = int(found_version.split(".")[0])
    except ValueError:
        raise SchemaError(f"{where}: unreadable schema version {found_version!r}") from None
    if major != expected.major:
        raise SchemaError(
            f"{where}: {kind} schema version {found_version} is not readable by this code "
            f"(reads major version {expected.major}, schemas/{kind}.json is {expected.version}); "
            f"use a pipeline release that writes {kind} {major}.x, or re-create the file"
        )


def check_arrow_schema(found: pa.Schema, kind: str, where: str | Path) -> None:
    """Version tag first, then every field this code reads must be there with the declared type."""
    check_tag((found.metadata or {}).get(META_KEY), kind, where)
    schema = load_schema(kind)
    for field in schema.arrow:
        idx = found.get_field_index(field.name)
        if idx < 0 and field.name in schema.optional:
            continue
        if idx < 0:
            raise SchemaError(f"{where}: missing field {field.name!r} of the {kind} schema")
        if not found.field(idx).type.equals(field.type):
            raise SchemaError(
                f"{where}: field {field.name!r} has type {found.field(idx).type}, the {kind} schema says {field.type}"
            )
