"""The lifetime section's row (benchmarks/lifetime_bench.py), read back by its exact first cell: the headline is
the total of processes left, then each command's count; a kill that found the command already finished is not
counted as a kill."""

from __future__ import annotations

from benchmarks import lifetime_bench


def test_the_row_totals_the_processes_left_per_command():
    res = {"wait_s": 30.0, "commands": [
        {"command": "score", "reference_s": 20.0, "peak": 9, "peak_s": 8.0, "killed": 2, "seen": 18, "left": 0},
        {"command": "onpolicy", "reference_s": 200.0, "peak": 14, "peak_s": 40.0, "killed": 1, "seen": 14, "left": 2},
    ]}
    row = next(line for line in lifetime_bench.markdown(res).splitlines() if line.startswith("| processes left"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "processes left after kill -9, per command"
    assert cells[1] == "**2** (score 0; onpolicy 2)" and cells[3] == "0"
    assert "score: 2 kills at U(8.0, 0.9 x 20.0) s, at most 9 processes below it" in cells[2], cells[2]
    assert "onpolicy: 1 kills" in cells[2] and "14 seen in all" in cells[2], cells[2]
