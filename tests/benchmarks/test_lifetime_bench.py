"""The lifetime section's row (benchmarks/lifetime_bench.py), read back by its exact first cell: the headline is
the total of processes left, then each command's count; a kill that found the command already finished is not
counted as a kill."""

from __future__ import annotations

from benchmarks import lifetime_bench


def test_the_row_totals_the_processes_left_per_command():
    res = {"wait_s": 30.0, "commands": [
        {"command": "score", "reference_s": 20.0, "killed": 2, "seen": 9, "left": 0},
        {"command": "onpolicy", "reference_s": 200.0, "killed": 1, "seen": 14, "left": 2},
    ]}
    row = next(line for line in lifetime_bench.markdown(res).splitlines() if line.startswith("| processes left"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "processes left after kill -9, per command"
    assert cells[1] == "**2** (score 0; onpolicy 2)" and cells[3] == "0"
    assert "score: 2 kills" in cells[2] and "onpolicy: 1 kills" in cells[2] and "14 processes seen" in cells[2]
