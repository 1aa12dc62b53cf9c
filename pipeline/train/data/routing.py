"""Routing: which teacher cache each sample is taken from, by one of its tags (`teachers={TAG: CACHE, default: ...}`).

A sample (sample_id) is taken from the cache of its `tags[route_key]`, or from `default`'s; the loader reads every
routed cache and keeps, per row, only the rows its route chose. A tag no route covers is refused (or, with
`on_unrouted=skip`, skipped and counted); a sample whose route's cache has no row for it is refused, naming it.
Routing reads each row's tags, which the cache index does not hold, so a routed run reads the shards' footers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.errors import InputError
from pipeline.store.cache import cache_root
from pipeline.store.shards import ShardError

UNROUTED = -2  # the row's tag has no route (and there is no default)
ELSEWHERE = -1  # the row's sample routes to another cache


class Router:
    """The routes of one run; `rows` reads a shard's tags, `check` decides which rows are kept."""

    def __init__(self, routes: dict[str, str | Path], route_key: str, on_unrouted: str) -> None:
        self.names = sorted(routes)
        self.route_key, self.on_unrouted = route_key, on_unrouted
        self.routes = {n: Path(routes[n]).resolve() for n in self.names}
        self.unrouted = 0  # samples skipped under on_unrouted=skip
        self._ids: list[np.ndarray] = []  # sample ids and tags of every row read, for the checks
        self._tags: list[str | None] = []

    def caches(self) -> list[str]:
        """The routed caches, each once: what the loader reads."""
        return sorted({str(v) for v in self.routes.values()})

    def rows(self, pf: pq.ParquetFile, path: Path) -> np.ndarray:
        """Per row of a scored shard: the index of the teacher (route) it is kept for; ELSEWHERE: its sample routes
        to another cache; UNROUTED: its tag has no route (and there is no default)."""
        if "tags" not in pf.schema_arrow.names:
            raise ShardError(f"{path}: scored before schema 1.1, its rows carry no tags to route on; rescore it with "
                             "gkd score, or train on it with cache=[...] instead of teachers")
        cache = cache_root(path).resolve()
        table = pf.read(columns=["sample_id", "tags"])
        self._ids.append(np.asarray(table.column("sample_id").to_pylist(), "U"))
        out = np.empty(table.num_rows, np.int64)
        for i, tags in enumerate(table.column("tags").to_pylist()):
            tag = dict(tags or []).get(self.route_key)
            name = tag if tag in self.routes and tag != "default" else "default" if "default" in self.routes else None
            self._tags.append(tag)
            if name is None:
                out[i] = UNROUTED
            else:
                out[i] = self.names.index(name) if self.routes[name] == cache else ELSEWHERE
        return out

    def check(self, route: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Which rows to keep (`route` as `rows` gave it, all shards in order; `keep`: the rows kept so far);
        refuses (or skips and counts) samples whose tag has no route, and samples whose route's cache has no row
        for them."""
        ids, tags = np.concatenate(self._ids), self._tags
        unrouted = route == UNROUTED
        if unrouted.any():
            found = sorted({str(tags[i]) for i in np.flatnonzero(unrouted)})
            if self.on_unrouted == "error":
                raise InputError(
                    f"{int(unrouted.sum())} cached row(s) have {self.route_key}={', '.join(found)}, which no teacher "
                    f"route covers (teachers: {', '.join(self.names)}); add a route or `default`, or "
                    "on_unrouted=skip to skip and count them")
            self.unrouted = len(set(ids[unrouted]))
        kept = route >= 0
        missing = set(ids[(route != UNROUTED)]) - set(ids[kept & keep])
        if missing:
            first = sorted(missing)[:5]
            where = {str(ids[i]): (tags[i], self.names[route[i]] if route[i] >= 0 else None) for i in range(len(ids))}
            raise ShardError(
                f"{len(missing)} sample(s) route to a teacher cache that has no row for them, e.g. "
                + ", ".join(f"{s} ({self.route_key}={where[s][0]})" for s in first)
                + "; score them into that cache (gkd score --tags TAG --cache CACHE)")
        return kept

    def fingerprint(self) -> str:
        """What the data order's fingerprint adds: other routes keep other rows, hence another order."""
        return f"routes|{self.route_key}|{sorted((n, str(v)) for n, v in self.routes.items())}"
