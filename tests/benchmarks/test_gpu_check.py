"""The prepared device check (benchmarks/gpu_check.py) runs end to end on this CPU machine in its tiny mode, so the
device session's one run of it is not the first: every part runs and records its results in the JSON, and `--write`
makes BENCHMARKS.md's GPU section with the issue's rows, keeping every other section."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks.gpu_check import ROW_TITLES, rows
from benchmarks.report import old_sections

REPO = Path(__file__).resolve().parents[2]


def _temps() -> set[Path]:
    tmp = Path(tempfile.gettempdir())
    return set(tmp.glob("gkd-gpu-check-*")) | set(tmp.glob("gkd-gpu-bench-*"))


def test_gpu_check_tiny_runs_and_writes_the_section(tmp_path):
    out = tmp_path / "check.json"
    before = _temps()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--tiny", "--steps", "1", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _temps() == before  # its students and caches removed
    res = json.loads(out.read_text())
    assert list(res["parts"]) == ["cuda_tests", "fused_0.5b", "fused_1.5b", "qwen35"]
    tests = res["parts"]["cuda_tests"]
    assert tests["returncode"] == 0 and "error" not in tests, tests
    assert tests["counts"].get("collected", 0) > 20, tests  # the three files' tests, collected only
    for name in ("fused_0.5b", "fused_1.5b"):
        part = res["parts"][name]
        assert [(r["tokens"], r["variant"]) for r in part["runs"]] == [(64, "fused"), (64, "unfused")]
        assert all("error" not in r for r in part["runs"]), part["runs"]
        fused, unfused = part["runs"]
        assert fused["losses"][0] == pytest.approx(unfused["losses"][0], rel=1e-2)
    q = res["parts"]["qwen35"]["runs"]
    assert q["torch"]["kernel"].endswith("torch_chunk_gated_delta_rule"), q
    assert q["torch"]["tokens_per_s"] > 0 and 0.01 < q["torch"]["first_loss"] < 100, q
    if "error" in q["fla"]:  # this machine has no flash-linear-attention (the CPU set must not)
        assert q["fla"]["error"].startswith("flash-linear-attention not in use"), q
    assert res["versions"]["torch"] and res["machine"]

    bench = tmp_path / "BENCHMARKS.md"
    shutil.copy(REPO / "BENCHMARKS.md", bench)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--write", str(out), "--benchmarks",
                           str(bench)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    new, old = old_sections(bench), old_sections(REPO / "BENCHMARKS.md")
    assert {k: v for k, v in new.items() if k != "gpu"} == {k: v for k, v in old.items() if k != "gpu"}
    lines = new["gpu"].splitlines()
    for title in ROW_TITLES:
        assert sum(line.startswith(title) for line in lines) == 1, (title, new["gpu"][:3000])
    assert "_Measured by `python -m benchmarks.gpu_check" in new["gpu"]


def test_rows_from_a_gpu_run():
    """The headline rows from a result shaped as a GPU run's (numbers made up): the ratios and MFU they print."""
    def run(tokens, variant, tps, peak, mfu):
        return {"tokens": tokens, "variant": variant, "tokens_per_s": tps, "peak_gib": peak, "mfu": mfu}

    res = {"tiny": False, "device": {"memory_gib": 139.8}, "parts": {
        "fused_0.5b": {"runs": [run(16384, "fused", 54_000.0, 32.0, 0.28), run(16384, "unfused", 55_000.0, 50.0, 0.29),
                                run(4096, "fused", 33_000.0, 15.0, 0.12), run(4096, "unfused", 34_000.0, 19.0, 0.12)]},
        "fused_1.5b": {"peak_tflops": 989.0, "runs": [run(16384, "fused", 25_000.0, 60.0, 0.351),
                                                      {"tokens": 16384, "variant": "unfused", "error": "out of memory"}]},
        "qwen35": {"widths": {"hidden_size": 2560, "vocab_size": 248_320}, "layers": 4, "seq_length": 4096,
                   "runs": {"fla": {"tokens_per_s": 30_000.0, "peak_gib": 20.0, "first_loss": 0.61},
                            "torch": {"tokens_per_s": 3_000.0, "peak_gib": 30.0, "first_loss": 0.6101}}},
        "cuda_tests": {"counts": {"passed": 66, "skipped": 2}},
    }}
    text = "\n".join(rows(res))
    assert f"{ROW_TITLES[0]} 0.98× (54,000 vs 55,000 tokens/s) in 0.64× the peak GPU memory" in text, text
    assert "at 4k 0.97× in 0.79× the memory" in text
    assert f"{ROW_TITLES[1]} 35.1 % fused (25,000 tokens/s, 60.0 GiB peak); unfused not measured: 16,384 unfused: " \
           "out of memory" in text, text
    assert f"{ROW_TITLES[2]} 30,000 vs 3,000 tokens/s (10.0×" in text, text
    assert f"{ROW_TITLES[3]} 66 passed, 2 skipped;" in text, text
