"""The prepared GPU benchmark script runs end to end (its tiny shape, on this CPU machine), so a CUDA machine's one
run is not the first run of this code: every (tokens, variant) row is measured, none errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_bench_tiny_runs(tmp_path):
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_bench", "--tiny", "--tokens", "64", "--steps", "1",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(r["tokens"], r["variant"]) for r in res["runs"]] == [(64, "fused"), (64, "unfused")]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in res["runs"]), res["runs"]
    assert "| 64 | fused |" in proc.stdout
