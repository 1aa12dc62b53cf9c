"""Core attention for Megatron-Core's local layer spec over `torch.nn.functional.scaled_dot_product_attention`.

Why: the local spec's `DotProductAttention` materialises the `[b, heads, sq, sk]` scores (baddbmm -> softmax ->
bmm, all kept for backward), which caps the sequence length and is slow; Megatron's fused kernels for it are CUDA
extensions for fp16/bf16 only, and its flash path is Transformer Engine, which does not exist on CPU. SDPA gives
PyTorch's flash / memory-efficient kernels on GPU and its fused flash kernel on CPU, with no extra dependency.

`attention="sdpa"` (the default) swaps `SDPAttention` into the spec's `core_attention`; `attention="local"` keeps
Megatron's module (the reference the tests compare against). Everything else in the layer (fused QKV, RoPE, output
projection, TP) is Megatron's own, so checkpoints and the HF mapping are the same for both.

The contract we implement (megatron-core 0.16.1, `Attention.forward` -> `core_attention(...)`):
- inputs per TP rank: query `[sq, b, np, hn]`, key/value `[sk, b, ng, hn]` (np query heads over ng groups);
  output `[sq, b, np * hn]`.
- `attention_mask`: None means the layer's mask type decides (causal: SDPA's `is_causal`, which lets the flash
  kernels skip the masked half instead of reading a mask); else a bool tensor broadcastable to `[b, 1, sq, sk]`
  with True = masked out (Megatron's convention, e.g. a block-diagonal causal mask for packed rows), given to SDPA
  inverted (SDPA: True = attend). A mask that is exactly block-diagonal causal is instead run as one causal SDPA
  call per document (`packed_segments`): the kernels then skip the masked triangle and the other documents' blocks
  (sum of L_i^2 / 2 instead of S^2 work; a masked call cannot skip anything). As in Megatron's unfused path, an
  explicit mask replaces the causal one. The
  call's `attn_mask_type` wins over the constructor's, as in Transformer Engine's module (Megatron's unfused one
  ignores it; training always passes the layer's own type, so the two agree there).
- `packed_seq_params`: the trainer's packed rows come as `DocumentSpans` (each row's document spans, from the
  loader's `doc_ids`) with `attention_mask=None`, and take the per-document path directly: no `[B, 1, S, S]` mask
  is built or checked, so a packed micro-batch costs O(B*S) beside the kernels at any sequence length (the mask is
  64 MiB per row at 8,192 tokens, 1 GiB at 32,768, and reading it back into spans is O(S^2) work per forward).
  Megatron hands `packed_seq_params` from `GPTModel.forward` to `core_attention` untouched; every other use of it
  in megatron-core 0.16.1 tests `qkv_format == "thd"` (RoPE, the q/k/v layout), which "sbhd" is not, and its RoPE
  length is `max_seqlen_q`, the row length, as without it. Megatron's own module refuses it (`attention=local`
  gets the mask). THD `PackedSeqParams` (Transformer Engine's varlen format) stays refused.
- context parallelism (`TransformerConfig.context_parallel_size` > 1): the micro-batch comes as `ContextSpans`, this
  rank's zig-zag chunks of the queries against the all-gathered keys and values, with the documents on global
  columns (`_context_parallel`; pipeline/train/parallel/context_parallel.py); anything else is refused under CP.
- softmax scale: `softmax_scale` or 1/sqrt(hn). Megatron's `apply_query_key_layer_scaling` divides the scores by
  the layer number and multiplies them back inside the softmax (an fp16 overflow guard), so the net scale is the same.
- A query row whose keys are all masked: Megatron fills masked scores with -10000 and so averages every key; SDPA
  returns 0 there. Neither is meaningful; block-diagonal causal masks never have such rows (a token sees itself).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from pipeline.train.data.packing import attention_mask
from pipeline.train.parallel.context_parallel import gather_sequence

Tensor = torch.Tensor
BACKENDS = ("sdpa", "local")
_TORCH_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa


@dataclass
class DocumentSpans(PackedSeqParams):
    """Packed rows as their documents' column spans, for `SDPAttention` (see the module docstring): row b holds
    documents [start, end) in `spans[b]`, covering 0..S-1 in order (padding is a span of its own)."""

    spans: list[list[tuple[int, int]]] | None = None


@dataclass
class ContextSpans(DocumentSpans):
    """A context-parallel micro-batch (pipeline/train/parallel/context_parallel.py): `spans` are each row's document spans
    over the WHOLE row of `max_seqlen_q` columns (global positions), this rank holding zig-zag chunks `cp_rank`
    and 2 * cp_size - 1 - cp_rank of it. `max_seqlen_q` is also what Megatron's RoPE takes as the sequence length
    before it selects this rank's chunks of the position embedding (gpt_model `get_rotary_seq_len`)."""

    cp_rank: int = 0
    cp_size: int = 1
    # The masks of query pieces that start inside a document, one per (offset, queries, keys), shared by every layer
    # (and row) of a forward: each is an O(S) strided view (`_lower_right_mask`).
    masks: dict = field(default_factory=dict)


def context_spans(doc_ids: Tensor, packed: bool, cp_rank: int, cp_size: int, cp_group) -> ContextSpans:
    """`ContextSpans` of a context-parallel micro-batch from its whole padded rows' doc_ids [B, W]: the document
    spans of packed rows, one span per row otherwise (a padded row is causal over all its columns, as without CP)."""
    b, w = doc_ids.shape
    spans = document_spans(doc_ids).spans if packed else [[(0, w)] for _ in range(b)]
    return ContextSpans(qkv_format="sbhd", max_seqlen_q=w, max_seqlen_kv=w, spans=spans, cp_group=cp_group,
                        cp_rank=cp_rank, cp_size=cp_size)


def document_spans(doc_ids: Tensor) -> DocumentSpans:
    """`DocumentSpans` of packed rows from their per-token sample ids `doc_ids` [B, S] (-1 = padding): a span starts
    wherever the id changes. For the loader's layout (a row's samples side by side, padding after them) these are
    the spans `packed_segments` reads off `packing.attention_mask(doc_ids)`, at O(B*S) instead of O(B*S^2)."""
    b, s = doc_ids.shape
    starts = torch.ones(b, s, dtype=torch.bool)
    starts[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).cpu()
    return DocumentSpans(qkv_format="sbhd", max_seqlen_q=s, max_seqlen_kv=s, spans=_spans(starts))


def _spans(starts: Tensor) -> list[list[tuple[int, int]]]:
    """Per row of a bool [B, S] tensor (True where a document starts; column 0 always does), its [start, end) spans."""
    out = []
    for row in starts.cpu():
        idx = [*row.nonzero().flatten().tolist(), row.shape[0]]
        out.append(list(zip(idx[:-1], idx[1:], strict=True)))
    return out


class SDPAttention(MegatronModule):
    """Drop-in `core_attention` for the local spec (same constructor and forward signature as DotProductAttention)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__(config=config)
        # Refuse what this module does not implement rather than computing something else.
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {
            "attention_dropout": dropout != 0.0,  # Megatron draws it from its TP-aware RNG tracker; we do not
            "softmax_type": config.softmax_type != "vanilla",
            "window_size": config.window_size is not None,
        }
        bad = [name for name, flag in unsupported.items() if flag]
        if bad:
            raise ValueError(f"attention=sdpa does not support {', '.join(bad)} (TransformerConfig); use attention=local")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention=sdpa: attention_bias is not supported")
        if packed_seq_params is not None and not isinstance(packed_seq_params, DocumentSpans):
            raise ValueError("attention=sdpa: THD packed_seq_params (Transformer Engine's format) are not supported; "
                             "pass packed rows as DocumentSpans or a block-diagonal attention_mask")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, heads, hn = query.shape
        if isinstance(packed_seq_params, ContextSpans):
            if attention_mask is not None or sq != key.shape[0]:
                raise ValueError("context parallelism: self-attention over ContextSpans only, no attention_mask")
            out = self._context_parallel(query, key, value, packed_seq_params)
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)
        if self.config.context_parallel_size != 1:
            raise ValueError("attention=sdpa under context parallelism takes its micro-batches as ContextSpans "
                             "(pipeline/train/parallel/context_parallel.py)")
        # [s, b, n, hn] -> [b, n, s, hn]: views, no copy (the kernels take strided inputs).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if packed_seq_params is not None:
            spans = packed_seq_params.spans
            if attention_mask is not None or sq != key.shape[0] or not _tiles(spans, b, sq):
                raise ValueError(f"DocumentSpans must tile 0..{sq} of each of the {b} rows in order (self-attention, "
                                 "no attention_mask beside them)")
            out = self._per_document(q, k, v, spans)
        elif attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError(f"attention_mask must be bool (True = masked out), got {attention_mask.dtype}")
            segments = packed_segments(attention_mask, b, sq, key.shape[0])
            if segments is not None:
                out = self._per_document(q, k, v, segments)
            else:
                out = self._sdpa(q, k, v, ~attention_mask, False)  # Megatron: True = masked out; SDPA: attend
        else:
            causal = mask_type == AttnMaskType.causal and sq > 1
            if causal and sq != key.shape[0]:
                raise ValueError(f"causal attention needs sq == sk, got {sq} and {key.shape[0]}")
            out = self._sdpa(q, k, v, None, causal)
        # [b, np, sq, hn] -> [sq, b, np * hn], the layout linear_proj expects.
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        heads, groups = q.shape[1], k.shape[1]
        gqa = heads != groups
        if gqa and not _native_gqa(q, mask):
            k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
            gqa = False
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=causal, scale=self.softmax_scale,
            **({"enable_gqa": True} if gqa else {}),
        )

    def _per_document(self, q: Tensor, k: Tensor, v: Tensor, segments: list[list[tuple[int, int]]]) -> Tensor:
        """Block-diagonal causal attention as one causal SDPA call per document: the kernels skip the masked
        upper triangle and never touch the other documents' blocks (sum of L_i^2 / 2 instead of S^2).

        The documents are cut with `split`, whose backward is one `cat` of the pieces' gradients; cutting them by
        indexing would make each piece's backward zero-fill a gradient of the whole [b, n, s, d] input and add it
        up (measured: 3,192 fills, 0.54 s of a 9.8 s profile of four packed steps of the bench's student)."""
        rows = []
        for row, qr, kr, vr in zip(segments, q.split(1), k.split(1), v.split(1), strict=True):
            lengths = [e - s for s, e in row]
            rows.append(torch.cat([self._sdpa(qd, kd, vd, None, qd.shape[2] > 1) for qd, kd, vd in zip(
                qr.split(lengths, dim=2), kr.split(lengths, dim=2), vr.split(lengths, dim=2), strict=True)], dim=2))
        return torch.cat(rows, dim=0)

    def _context_parallel(self, query: Tensor, key: Tensor, value: Tensor, ctx: ContextSpans) -> Tensor:
        """Attention of this rank's zig-zag query chunks over the whole row's keys and values (all-gathered):
        per row, per local chunk, per document piece in it, one SDPA call over the keys of that document up to the
        piece's end. A piece that starts its document is plain causal; one that continues a document begun in an
        earlier chunk sees all of that document's earlier keys and its own causally (`_lower_right_mask`)."""
        n = ctx.cp_size
        k_all, v_all = (gather_sequence(t, ctx.cp_group, n).permute(1, 2, 0, 3) for t in (key, value))
        q = query.permute(1, 2, 0, 3)  # [b, np, 2c, hn]
        c = q.shape[2] // 2
        rows = []
        for spans, qr, kr, vr in zip(ctx.spans, q.split(1), k_all.split(1), v_all.split(1), strict=True):
            pieces = []
            for chunk, qc in zip((ctx.cp_rank, 2 * n - 1 - ctx.cp_rank), qr.split(c, dim=2), strict=True):
                lo, hi = chunk * c, (chunk + 1) * c
                cut = [(max(s, lo), min(e, hi), s) for s, e in spans if e > lo and s < hi]
                for (a, z, s), qd in zip(cut, qc.split([z - a for a, z, _ in cut], dim=2), strict=True):
                    kd, vd = kr[:, :, s:z], vr[:, :, s:z]
                    if a == s:
                        pieces.append(self._sdpa(qd, kd, vd, None, z - a > 1))
                    else:  # the mask wants the queries in reverse order (see _lower_right_mask)
                        mask = _lower_right_mask(ctx.masks, a - s, z - a, q)
                        pieces.append(self._sdpa(qd.flip(2), kd, vd, mask, False).flip(2))
            rows.append(torch.cat(pieces, dim=2))
        return torch.cat(rows, dim=0)


def _lower_right_mask(cache: dict, offset: int, queries: int, q: Tensor) -> Tensor:
    """The additive mask of `queries` queries at positions offset..offset+queries-1 of a document over its keys
    0..offset+queries-1 (query i sees keys j <= offset + i), for the queries in REVERSE order: then entry (i', j)
    is allowed iff i' + j <= offset + queries - 1, a function of i' + j, which is the strided view u[i' + j] of one
    vector (strides (1, 1)). The kernels read it like a dense mask, but it costs O(offset + queries) memory, not
    O(queries x keys): a dense [c, S] float mask per layer would outweigh the activations CP saves. SDPA's
    `causal_lower_right` bias would materialise it on CPU."""
    key = (offset, queries, q.dtype, q.device)
    if key not in cache:
        keys = offset + queries
        u = torch.full((queries + keys - 1,), float("-inf"), dtype=q.dtype, device=q.device)
        u[:keys] = 0.0
        cache[key] = u.as_strided((1, 1, queries, keys), (0, 0, 1, 1))
    return cache[key]


def attention_inputs(doc_ids: Tensor, packed: bool, backend: str) -> dict:
    """How a micro-batch keeps its rows' samples apart, as `GPTModel.forward` keywords. Padded rows: nothing (the
    layers' causal mask). Packed rows: `sdpa` gets their `document_spans` (no `[B, 1, S, S]` mask is built); Megatron's
    own module (`local`) the block-diagonal causal mask, True = masked (`packing.attention_mask`; its unfused softmax
    applies it since masked_softmax_fusion is off)."""
    if not packed:
        return {"attention_mask": None}
    if backend == "sdpa":
        return {"attention_mask": None, "packed_seq_params": document_spans(doc_ids)}
    return {"attention_mask": attention_mask(doc_ids)}


def _tiles(spans: list[list[tuple[int, int]]] | None, rows: int, s: int) -> bool:
    """Whether `spans` holds, for each of `rows` rows, non-empty spans that cover 0..s-1 back to back."""
    if spans is None or len(spans) != rows:
        return False
    for row in spans:
        end = 0
        for start, stop in row:
            if start != end or stop <= start:
                return False
            end = stop
        if end != s:
            return False
    return True


# The mask is the same tensor for every layer of a forward: check its structure once (weakref, version).
_segment_cache: list = [None, -1, None]


def packed_segments(mask: Tensor, batch: int, sq: int, sk: int) -> list[list[tuple[int, int]]] | None:
    """Per row, the [start, end) spans of a block-diagonal causal mask (Megatron's format, True = masked out),
    or None when `mask` is anything else (it is then applied as given). A span starts wherever a token may not
    see the one before it; the mask must then equal exactly "causal within spans, nothing across"."""
    if sq != sk or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2:] != (sq, sk) or mask.shape[0] not in (1, batch):
        return None
    ref, version, cached = _segment_cache
    if ref is not None and ref() is mask and version == mask._version:
        return cached
    m = mask[:, 0]
    if sq > 1:
        starts = torch.cat([torch.ones_like(m[:, :1, 0]), m.diagonal(offset=-1, dim1=1, dim2=2)], dim=1)
    else:
        starts = torch.ones_like(m[:, :, 0])
    doc = starts.long().cumsum(1)
    tril = torch.ones(sq, sq, dtype=torch.bool, device=mask.device).tril_()
    expected = ~((doc[:, :, None] == doc[:, None, :]) & tril)
    result = None
    if torch.equal(expected, m):
        result = _spans(starts)
        if len(result) == 1 and batch > 1:
            result = result * batch
    _segment_cache[:] = [weakref.ref(mask), mask._version, result]
    return result


def _native_gqa(q: Tensor, mask: Tensor | None) -> bool:
    """Whether SDPA's enable_gqa keeps a fused kernel for these inputs. CPU: its flash kernel takes GQA with or
    without a mask. CUDA: only the flash backend honours enable_gqa (fp16/bf16, no mask); the memory-efficient one
    would fall back to the math path, so there we expand k/v like Megatron does."""
    if not _TORCH_HAS_GQA:
        return False
    if q.device.type == "cpu":
        return True
    return mask is None and q.dtype in (torch.float16, torch.bfloat16)


def layer_spec(attention: str = "sdpa", qk_layernorm: bool = False) -> ModuleSpec:
    """Megatron's local GPT layer spec (RMSNorm; per-head q/k RMSNorm if asked) with the chosen core attention."""
    if attention not in BACKENDS:
        raise ValueError(f"attention={attention!r}: choose one of {', '.join(BACKENDS)}")
    # A fresh spec tree per call: safe to edit.
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
