"""The short CI version of `make faults` (benchmarks/faults.py): kill -9 at a seeded point each of the real
`gkd score`, `gkd generate` and `gkd train` (smaller workloads; ~3 min on 2 shared cores: 9 starts of vLLM or
Megatron), each rerun until it finishes and compared with an uninterrupted run by key (train: losses and final
tensors bit for bit), with no process of a killed command left (counted for all four commands, on-policy
included, by the lifetime section: benchmarks/lifetime_bench.py); and the section's table. Each command's
kill-and-resume is also tested on its own (tests/score, tests/generate, tests/train): this checks the harness."""

from __future__ import annotations

import pytest

from benchmarks import faults


@pytest.mark.slow  # CI: each command's kill-and-resume in its own tests; this checks the harness (`make faults`)
def test_kill_points_survive_and_the_table_has_its_rows(tmp_path):
    res = faults.run(tmp_path, points={"score": 1, "generate": 1, "train": 1}, seed=1, only=("kill",), small=True)
    for k in res["kill"]:
        assert k["failures"] == [], k
        assert k["survived"] == k["killed"] == res["points"][k["command"]], k
        assert k["processes_left"] == 0, k  # no engine or worker of a killed command alive after it
    table = faults.markdown({**res, "tests": {row: {"passed": 1, "failed": [], "skipped": []}
                                              for row in faults.TEST_GROUPS}})
    assert "| kill -9 points survived | score 1 / 1; generate 1 / 1; train 1 / 1 " in table
    for row in ("full-disk cases survived", "concurrent-writer cases survived", "bad inputs refused cleanly"):
        assert f"| {row} | 1 / 1 |" in table
