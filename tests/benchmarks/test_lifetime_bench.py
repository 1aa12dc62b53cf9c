"""The lifetime section's row (benchmarks/lifetime_bench.py), read back by its exact first cell: the headline is
the total of processes left, then each command's count; a kill that found the command already finished is not
counted as a kill."""

from __future__ import annotations

from benchmarks import lifetime_bench


def test_the_row_totals_the_processes_left_per_command():
    res = {"wait_s": 30.0, "commands": [
        {"command": "score", "reference_s": 20.0, "target": 3, "starts": 3, "killed": 2, "at_kill_max": 9, "left": 0},
        {"command": "onpolicy", "reference_s": 200.0, "target": 7, "starts": 1, "killed": 1, "at_kill_max": 14,
         "left": 2},
    ]}
    row = next(line for line in lifetime_bench.markdown(res).splitlines() if line.startswith("| processes left"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "processes left after kill -9, per command"
    assert cells[1] == "**2** (score 0; onpolicy 2)" and cells[3] == "0"
    assert "score: 2 kills (3 starts), each once 3 processes were below it" in cells[2], cells[2]
    assert "onpolicy: 1 kills (1 starts)" in cells[2] and "at most 14 alive at a kill" in cells[2], cells[2]
