"""attention=sdpa (pipeline/train/models/attention.py) equals Megatron's own DotProductAttention (attention=local).

Run: ``python -m pytest tests/train/models/test_attention.py`` (``-m "not distributed"`` skips the torchrun test).
The SMALL models of tiny_models.build_random_hf have 4 query heads over 2 KV heads, so every model-level case is
GQA; the Llama one has tied embeddings, the Qwen2 one qkv bias. "Packed" rows carry an explicit block-diagonal causal
mask in Megatron's format (bool [B, 1, S, S], True = masked out), built here independently of the loader.

Tolerance (float32): SDPA's CPU flash kernel sums the softmax block by block with a running max, Megatron's path
takes one full softmax, so the two round differently. Measured here: logits and every parameter gradient agree to
<= 1.4e-6 of the tensor's largest entry, the module's output and q/k/v gradients to <= 2.1e-6 (inputs drawn at
twice unit scale, so sharper softmaxes). We allow 1e-5 of the scale (~5x margin); the bugs
this test exists for (a wrong scale, an inverted or ignored mask, a wrong GQA head mapping, a transposed output)
move logits by 1e-2 to 1 of their scale (the packed case checks that the mask moves them at all).

Device: the inputs go where Megatron computes (`_device`: the model's parameters, which build_model moves to CUDA
when there is one; for the bare attention modules, the current CUDA device their buffers are allocated on), so the
same tests run on a CPU machine and a CUDA one. The numbers above were measured on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_fixtures import ARCHS, peak_tensor_bytes
from train_fixtures import random_ids as _ids

from pipeline.train.models.megatron import build_model, load_hf_weights
from pipeline.train.parallel.groups import destroy_distributed, init_distributed

REPO = Path(__file__).resolve().parents[3]
RTOL = 1e-5  # of each tensor's max |entry|, see the module docstring


def block_causal_mask(lengths_per_row: list[list[int]], seq: int) -> torch.Tensor:
    """Megatron-format mask of packed rows: documents of the given lengths side by side, causal inside each,
    nothing across them; a row's tail past its documents is one more document (as padding would be)."""
    mask = torch.ones(len(lengths_per_row), 1, seq, seq, dtype=torch.bool)
    for b, lengths in enumerate(lengths_per_row):
        start = 0
        for n in [*lengths, seq - sum(lengths)]:
            mask[b, 0, start : start + n, start : start + n] = ~torch.ones(n, n, dtype=torch.bool).tril()
            start += n
    return mask


PACKED = [[10, 14], [5, 7, 8]]  # row 0 fills all 24 positions; row 1 has a 4-token tail


def _device(model: torch.nn.Module | None = None) -> torch.device:
    """Where Megatron computes: `model`'s parameters (build_model moves them to CUDA when there is one), else, for
    a parameterless module such as DotProductAttention, the device its buffers are allocated on (Megatron's
    torch.cuda.current_device(); the CPU under pipeline/train/parallel/compat.py)."""
    if model is not None:
        return next(model.parameters()).device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    scale = expected.abs().max().item()
    assert scale > 0, name
    gap = (actual - expected).abs().max().item() / scale
    assert gap <= RTOL, f"{name}: sdpa differs from local by {gap:.3g} of its scale (> {RTOL})"


def packed_doc_ids(lengths_per_row: list[list[int]], seq: int) -> torch.Tensor:
    """The loader's doc_ids [B, S] of the same layout as block_causal_mask: documents 0, 1, ... side by side, -1
    for the tail (padding)."""
    doc = torch.full((len(lengths_per_row), seq), -1, dtype=torch.int32)
    for b, lengths in enumerate(lengths_per_row):
        start = 0
        for d, n in enumerate(lengths):
            doc[b, start : start + n] = d
            start += n
    return doc


def _forward_backward(hf_dir: Path, attention: str, mask: torch.Tensor | None, ids: torch.Tensor, **attn):
    model = build_model(hf_dir, attention=attention)
    load_hf_weights(model, hf_dir)
    dev = _device(model)
    ids = ids.to(dev)
    logits = model(ids, torch.arange(ids.shape[1], device=dev).expand_as(ids), None if mask is None else mask.to(dev),
                   **attn)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).to(dev)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", ["causal", "packed", "spans"])
def test_sdpa_matches_local_logits_and_gradients(hf_dirs, single_process, arch, case):
    """"spans": sdpa given the packed rows' document spans and no mask (what the trainer passes it) against local
    given the block-diagonal mask."""
    from pipeline.train.models.attention import document_spans

    ids = _ids()
    mask = block_causal_mask(PACKED, ids.shape[1]) if case != "causal" else None
    ref_logits, ref_grads = _forward_backward(hf_dirs[arch], "local", mask, ids)
    if case == "spans":
        spans = document_spans(packed_doc_ids(PACKED, ids.shape[1]))
        logits, grads = _forward_backward(hf_dirs[arch], "sdpa", None, ids, packed_seq_params=spans)
    else:
        logits, grads = _forward_backward(hf_dirs[arch], "sdpa", mask, ids)
    _close(logits, ref_logits, "logits")
    assert sorted(grads) == sorted(ref_grads)
    for name in ref_grads:
        _close(grads[name], ref_grads[name], name)
    if case != "causal":  # the mask must matter: the second document of row 0 no longer sees the first
        causal, _ = _forward_backward(hf_dirs[arch], "local", None, ids)
        assert torch.equal(causal[0, :10], ref_logits[0, :10])  # the first document is causal either way
        assert (causal[0, 10:] - ref_logits[0, 10:]).abs().max() > 1e-2 * ref_logits.abs().max()


def _core_pair(heads: int, groups: int, mask_type=None, **config_kw):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from pipeline.train.models.attention import SDPAttention

    config = TransformerConfig(num_layers=4, hidden_size=heads * 16, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=16, attention_dropout=0.0, hidden_dropout=0.0,
                               use_cpu_initialization=True, **config_kw)
    kw = dict(config=config, layer_number=3, attn_mask_type=mask_type or AttnMaskType.causal, attention_type="self",
              softmax_scale=config.softmax_scale)
    return DotProductAttention(**kw), SDPAttention(**kw)


@pytest.mark.parametrize("groups", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("config_kw", [{}, {"softmax_scale": 0.3}, {"apply_query_key_layer_scaling": True}],
                         ids=["default-scale", "explicit-scale", "qk-layer-scaling"])
@pytest.mark.parametrize("case", ["causal", "packed", "no_mask", "any_mask"])
def test_core_attention_module_matches_megatron(single_process, groups, config_kw, case):
    """The module contract directly: q [sq, b, np, hn], k/v [sk, b, ng, hn] -> [sq, b, np * hn], and input grads."""
    from megatron.core.transformer.enums import AttnMaskType

    # Megatron's module ignores the call's attn_mask_type and uses its constructor's: give both the same one.
    mask_type = AttnMaskType.no_mask if case == "no_mask" else AttnMaskType.causal
    local, sdpa = _core_pair(4, groups, mask_type, **config_kw)
    dev = _device()  # the modules have no parameters; Megatron's allocates its buffers there
    g = torch.Generator().manual_seed(0)  # drawn on the CPU (same numbers on any machine), then moved
    sq, b = 24, 2
    q = (2 * torch.randn(sq, b, 4, 16, generator=g)).to(dev).requires_grad_()
    k = (2 * torch.randn(sq, b, groups, 16, generator=g)).to(dev).requires_grad_()
    v = torch.randn(sq, b, groups, 16, generator=g).to(dev).requires_grad_()
    mask = block_causal_mask(PACKED, sq) if case == "packed" else None
    if case == "any_mask":  # not block-diagonal: SDPA applies it as given (a token always sees itself)
        mask = (torch.rand(b, 1, sq, sq, generator=g) < 0.5) & ~torch.eye(sq, dtype=torch.bool)
    mask = None if mask is None else mask.to(dev)
    weights = torch.randn(sq, b, 4 * 16, generator=g).to(dev)
    results = []
    for module in (local, sdpa):
        out = module(q, k, v, mask, attn_mask_type=mask_type)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        results.append((out.detach(), grads))
    (ref, ref_grads), (out, grads) = results
    assert out.shape == (sq, b, 64)
    _close(out, ref, "output")
    for name, a, e in zip("qkv", grads, ref_grads, strict=True):
        _close(a, e, f"d{name}")


def test_bad_backend_and_unsupported_config_are_refused(single_process):
    from pipeline.train.models.attention import layer_spec

    with pytest.raises(ValueError, match="attention='flash'.*sdpa, local"):
        layer_spec("flash")
    with pytest.raises(ValueError, match="attention=sdpa does not support attention_dropout"):
        _dropout_pair()


def _dropout_pair():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from pipeline.train.models.attention import SDPAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, attention_dropout=0.1,
                               use_cpu_initialization=True)
    return SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


@pytest.mark.distributed
def test_tp2_sdpa_matches_tp1_local(hf_dirs, tmp_path):
    """SDPA at TP=2 (two KV groups split over the ranks: one per rank) against Megatron's attention at TP=1,
    causal and packed, under the shared cross-layout rule (tests/tolerance.py)."""
    from tolerance import assert_layout_close

    ids = _ids()
    mask = block_causal_mask(PACKED, ids.shape[1])
    torch.save({"ids": ids, "mask": mask, "weights_seed": 1}, tmp_path / "in.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "train" / "_attention_tp_worker.py"), str(tmp_path / "in.pt"), str(tmp_path),
           *(str(hf_dirs[a]) for a in ARCHS)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    init_distributed(tp=1, pp=1, seed=0)
    try:
        for arch in ARCHS:
            for case, m in (("causal", None), ("packed", mask)):
                tp2 = torch.load(tmp_path / f"{arch}-{case}.pt")
                logits, grads = _forward_backward(hf_dirs[arch], "local", m, ids)
                assert_layout_close(tp2["logits"], logits, f"{arch}/{case} logits")
                assert_layout_close(tp2["grads"], {k: grads[k] for k in tp2["grads"]}, f"{arch}/{case} grads")
    finally:
        destroy_distributed()


def test_packed_segments_recognises_block_diagonal_masks_only():
    from pipeline.train.models.attention import packed_segments

    mask = block_causal_mask(PACKED, 24)
    assert packed_segments(mask, 2, 24, 24) == [[(0, 10), (10, 24)], [(0, 5), (5, 12), (12, 20), (20, 24)]]
    mask[1, 0, 6, 2] = False  # one cross-document entry allowed: no longer block-diagonal (cache must notice)
    assert packed_segments(mask, 2, 24, 24) is None
    causal = block_causal_mask([[], []], 24)  # one document per row is plain causal
    assert packed_segments(causal, 2, 24, 24) == [[(0, 24)], [(0, 24)]]
    assert packed_segments(causal[:1], 2, 24, 24) == [[(0, 24)], [(0, 24)]]  # broadcast over the batch
    assert packed_segments(~causal, 2, 24, 24) is None  # inverted convention
    assert packed_segments(causal[:, :, :12], 2, 12, 24) is None  # sq != sk


def test_document_spans_are_the_masks_segments():
    """document_spans (O(S) from the loader's doc_ids) finds the spans packed_segments reads off the S x S mask the
    local backend gets, on loader layouts: full rows, a padded tail, one-token documents, all padding."""
    from pipeline.train.data.packing import attention_mask
    from pipeline.train.models.attention import attention_inputs, document_spans, packed_segments

    g = torch.Generator().manual_seed(5)
    layouts = [PACKED, [[24], [1, 1, 22]], [[3], []], [[1] * 24, [23]]]
    for _ in range(20):  # random rows: documents of 1..12 tokens until the row is full or stops early
        rows = []
        for _ in range(3):
            lengths, left = [], 24
            while left and torch.rand(1, generator=g).item() < 0.9:
                lengths.append(min(left, int(torch.randint(1, 13, (1,), generator=g))))
                left -= lengths[-1]
            rows.append(lengths)
        layouts.append(rows)
    for rows in layouts:
        doc = packed_doc_ids(rows, 24)
        spans = document_spans(doc)
        assert spans.spans == packed_segments(attention_mask(doc), len(rows), 24, 24), rows
        assert spans.qkv_format == "sbhd" and spans.max_seqlen_q == spans.max_seqlen_kv == 24  # Megatron's RoPE length
    doc = packed_doc_ids(PACKED, 24)
    assert attention_inputs(doc, False, "sdpa") == {"attention_mask": None}  # padded rows: the causal default
    assert set(attention_inputs(doc, True, "sdpa")) == {"attention_mask", "packed_seq_params"}
    local = attention_inputs(doc, True, "local")  # Megatron's module needs the mask
    assert torch.equal(local["attention_mask"], attention_mask(doc)) and "packed_seq_params" not in local


def test_bad_document_spans_and_thd_params_are_refused(single_process):
    from megatron.core.packed_seq_params import PackedSeqParams

    from pipeline.train.models.attention import DocumentSpans, document_spans

    _, sdpa = _core_pair(4, 2)
    q, k, v = torch.randn(24, 2, 4, 16), torch.randn(24, 2, 2, 16), torch.randn(24, 2, 2, 16)
    good = document_spans(packed_doc_ids(PACKED, 24))
    assert sdpa(q, k, v, None, packed_seq_params=good).shape == (24, 2, 64)
    short = [[(0, 10), (10, 24)], [(0, 5), (5, 12), (12, 20)]]
    gap = [[(0, 10), (11, 24)], [(0, 24)]]
    for spans in (short, gap, [[(0, 24)]]):  # the last: a row missing
        with pytest.raises(ValueError, match="DocumentSpans must tile 0..24 of each of the 2 rows"):
            sdpa(q, k, v, None, packed_seq_params=DocumentSpans(qkv_format="sbhd", spans=spans))
    with pytest.raises(ValueError, match="no attention_mask beside them"):
        sdpa(q, k, v, block_causal_mask(PACKED, 24), packed_seq_params=good)
    with pytest.raises(ValueError, match="THD packed_seq_params"):
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))


def _peak_growth(run, dev: torch.device) -> int:
    """Bytes the peak memory of `dev` grows by while `run()` runs: the peak of live CPU tensor bytes on the CPU, the
    caching allocator's peak on CUDA."""
    if dev.type != "cuda":
        return peak_tensor_bytes(run)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    run()
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - before


def test_packed_rows_cost_no_seq_squared_memory(hf_dirs, single_process):
    """A packed row of 8,192 tokens through the model as the trainer feeds it (document spans): peak memory stays
    below one S x S bool (64 MiB; 29 MiB of CPU tensors, the activations and logits). The same row given the
    block-diagonal mask measured 269 MiB (the mask, and packed_segments reading it back), which the first bound
    catches and the second shows. On CUDA the memory measured is the GPU's (`_peak_growth`): the mask is built on
    the model's device from doc_ids there, and it and packed_segments' S x S temporaries are the same bytes."""
    from pipeline.train.models.attention import attention_inputs

    s = 8192
    model = build_model(hf_dirs["llama"])
    dev = _device(model)
    doc = (torch.arange(s) // 100).to(torch.int32)[None].to(dev)  # 82 documents of 100 tokens (the last 92)
    ids = torch.randint(0, 256, (1, s), generator=torch.Generator().manual_seed(0)).to(dev)
    pos = torch.arange(s, device=dev)[None]
    growth = {}
    with torch.no_grad():
        model(ids[:, :64], pos[:, :64], **attention_inputs(doc[:, :64], True, "sdpa"))  # one-off allocations
        for backend in ("sdpa", "local"):  # local: the mask route, run here by sdpa's own masked path
            growth[backend] = _peak_growth(lambda b=backend: model(ids, pos, **attention_inputs(doc, True, b)), dev)
    assert growth["sdpa"] < s * s, {k: v / 2**20 for k, v in growth.items()}
    assert growth["local"] > 3 * s * s, {k: v / 2**20 for k, v in growth.items()}


def test_per_document_path_matches_the_masked_kernel(single_process):
    """The per-document calls give what one masked SDPA call gives (the path the mask would take otherwise)."""
    _, sdpa = _core_pair(4, 2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(24, 2, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(24, 2, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    mask = block_causal_mask(PACKED, 24)
    out = sdpa(q, k, v, mask)
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    ref = sdpa._sdpa(qq, kk, vv, ~mask, False).permute(2, 0, 1, 3).reshape(24, 2, 64)
    _close(out, ref, "output")
    w = torch.randn(out.shape, generator=g)
    for a, e, name in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v)),
                          "qkv", strict=True):
        _close(a, e, f"d{name}")
