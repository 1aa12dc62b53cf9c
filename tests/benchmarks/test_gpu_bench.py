"""The prepared GPU benchmark script runs end to end (its tiny shape, on this CPU machine), so a CUDA machine's one
run is not the first run of this code: every (tokens, variant) row is measured, none errors."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # CI: tests/benchmarks/test_gpu_check.py runs gpu_bench.run's tiny shape through the check
def test_gpu_bench_tiny_runs(tmp_path):
    out = tmp_path / "res.json"
    before = set(Path(tempfile.gettempdir()).glob("gkd-gpu-bench-*"))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_bench", "--tiny", "--tokens", "64", "--steps", "1",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(Path(tempfile.gettempdir()).glob("gkd-gpu-bench-*")) == before  # its student and caches removed
    res = json.loads(out.read_text())
    assert [(r["tokens"], r["variant"]) for r in res["runs"]] == [(64, "fused"), (64, "unfused")]
    assert all("error" not in r for r in res["runs"]), res["runs"]
    fused, unfused = res["runs"]
    # The step it timed is the real training step: the first (untimed) step's loss, on the same initial weights and
    # row, is the same through the fused and the unfused loss (bf16 rounding apart), and not a trivial value.
    assert len(fused["losses"]) == len(unfused["losses"]) == 2
    assert fused["losses"][0] == pytest.approx(unfused["losses"][0], rel=1e-2), (fused["losses"], unfused["losses"])
    assert 0.01 < fused["losses"][0] < 100
    for r in res["runs"]:  # the rate is the median step's, and the table prints the JSON's rate
        assert r["tokens_per_s"] == pytest.approx(64 / r["step_s"], rel=1e-9)
        assert f"| 64 | {r['variant']} | {r['tokens_per_s']:,.0f} |" in proc.stdout, proc.stdout
