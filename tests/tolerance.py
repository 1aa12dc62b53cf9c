"""The one rule for comparing two runs that differ only in process layout.

TP=2 vs TP=1, DP=2 vs DP=1, grad-accumulation 2 vs 1, Slurm jobs vs one process: such runs add the same float
numbers in another order (a vocab- or row-split matmul, an all-reduce, other thread counts in a fresh process), so
they agree only up to rounding noise. The rule, used by every cross-layout test:

1. **Compare where noise stays noise-sized**: losses, logits, gradients, and weights after *SGD* steps (an update
   linear in the gradient). Never compare weights after Adam steps: Adam's first updates are ≈ lr·sign(g), so
   rounding noise in a gradient entry near zero flips a full lr-sized update (issue #13: two Adam steps of lr 5e-3 at
   TP=2 vs TP=1 left 3 of 512 LoRA B entries 5.8e-5 of the tensor's scale apart, against gradient noise of 1e-6).
   Tests that train across layouts therefore pass `optimizer=sgd`.
2. **Tolerance**: per tensor, ``max |a − b| <= LAYOUT_RTOL · max |reference|`` with LAYOUT_RTOL = 3e-4 for
   float32 computations. Largest gaps measured here (2-core AMD EPYC, gloo, the tests below; issue #13): gradients
   TP=2 vs TP=1 8.5e-7 (LoRA adapter gradients 1.3e-5, the scalar grad norm 8.4e-6), logits 6.6e-7, loss sums
   1.1e-7, a LoRA adapter after 3 SGD steps at TP=2 vs TP=1 1.8e-6, one SGD update with the fused vs the unfused loss
   2.8e-5 (lm_head: each entry is a sum over tokens with heavy cancellation, so its noise relative to the largest
   entry is the largest seen) — 3e-4 leaves a margin of ~10x over the worst, for other CPUs' kernels. The bugs
   these tests exist for are 1e-2 of the scale and more (a plain row split of linear_fc1's LoRA B instead of the
   SwiGLU factory: 1.07; a per-micro-batch mean instead of the global count: > 1e-2). float64 gets the same margin
   in its own epsilon.
   When the runs start from the same weights, compare what training changed (final − initial), not the weights.
   To re-measure: ``GKD_LAYOUT_GAPS=/tmp/gaps.txt pytest ...`` appends every compared gap to that file.
3. **Same layout, same process order** (resume vs uninterrupted, rerun after a kill): exact by construction, so
   compare with ``torch.equal`` (`assert_same`), never with a tolerance.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

# The computation's precision decides the tolerance, not the container's dtype (loss sums computed in float32 are
# reported as float64): float32 unless a test computes in float64 throughout and says so.
LAYOUT_RTOL = {torch.float32: 3e-4, torch.float64: 3e-4 * torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps}


def layout_gap(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| as a fraction of max |expected| (0 when both are all zeros)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if not expected.numel():
        return 0.0
    scale, diff = float(expected.abs().max()), float((actual - expected).abs().max())
    return diff / scale if scale > 0 else diff


def assert_layout_close(actual, expected, name: str = "tensor", computed_in: torch.dtype = torch.float32) -> None:
    """Rule 2 for one tensor, or for every key of two mappings of tensors (same keys required)."""
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and set(actual) == set(expected), (
            f"{name}: keys differ: only in actual {sorted(set(actual) - set(expected))[:5]}, "
            f"only in expected {sorted(set(expected) - set(actual))[:5]}")
        for k in expected:
            assert_layout_close(actual[k], expected[k], f"{name}[{k}]", computed_in)
        return
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    rtol = LAYOUT_RTOL[computed_in]
    gap = layout_gap(actual, expected)
    if os.environ.get("GKD_LAYOUT_GAPS"):  # measuring the noise the rule is sized from: append every gap
        with open(os.environ["GKD_LAYOUT_GAPS"], "a") as f:
            f.write(f"{gap:.3e} {computed_in} {name}\n")
    assert gap <= rtol, f"{name}: differs by {gap:.3g} of its scale (cross-layout rule, tests/tolerance.py: <= {rtol:.3g})"


def assert_same(actual, expected, name: str = "tensor") -> None:
    """Rule 3: bit-identical tensors (or mappings of tensors; non-tensor values compared with ==)."""
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and set(actual) == set(expected), f"{name}: keys differ"
        for k in expected:
            assert_same(actual[k], expected[k], f"{name}[{k}]")
        return
    if torch.is_tensor(expected):
        assert torch.is_tensor(actual) and torch.equal(actual, expected), f"{name}: not bit-identical"
    else:
        assert actual == expected, f"{name}: {actual!r} != {expected!r}"


def assert_trains_alike(live: list[dict], cached: list[dict], start: Path, runs: Path, names: tuple[str, str],
                        label: str) -> None:
    """Two training runs of the same steps (their metrics rows, `live` vs `cached`): the same active tokens, per-step
    KD (jsd) and SFT losses within 1e-5 relative, and the weight updates of their exports (`runs/NAME` checkpoints,
    from the student folder `start`) under the cross-layout rule."""
    import sys

    from safetensors.torch import load_file

    from pipeline.cli import main as cli

    assert [m["active_tokens"] for m in live] == [m["active_tokens"] for m in cached]
    worst = max(abs(a["jsd"] - b["jsd"]) / b["jsd"] for a, b in zip(live, cached, strict=True))
    print(f"[{label}] worst per-step KD loss gap {worst:.2e} relative", file=sys.stderr)
    for a, b in zip(live, cached, strict=True):
        assert abs(a["jsd"] - b["jsd"]) <= 1e-5 * b["jsd"] and abs(a["sft"] - b["sft"]) <= 1e-5 * b["sft"], (a, b)
    w0 = load_file(start / "model.safetensors")
    for name in names:
        assert cli(["export", "--checkpoint", str(runs / name), "--out", str(runs / f"{name}-hf")]) == 0
    w_live, w_cache = (load_file(runs / f"{n}-hf" / "model.safetensors") for n in names)
    assert_layout_close({k: w_live[k] - w0[k] for k in w0}, {k: w_cache[k] - w0[k] for k in w0}, "update")
