"""`gkd generate --status` (which tasks have no complete shard) and `gkd slurm resubmit --stage generate`, which
reads it to submit only the missing tasks."""

from __future__ import annotations

from pathlib import Path

from pipeline.generate.run import main as generate_main
from pipeline.generate.sampler import GenerateConfig, output_path
from pipeline.slurm.cli import main as slurm_main
from pipeline.store.rollouts import rollout_row, write_rollouts


def _shard(out: Path, shard: int, num_shards: int) -> None:
    row = rollout_row(prompt_id=f"q{shard}", prompt_ids=[3, 4], completion_ids=[5], source="student",
                      policy_version=0)
    write_rollouts(output_path(GenerateConfig(out=str(out), num_shards=num_shards), shard), [row],
                   tokenizer_fingerprint="0" * 32)


def test_status_lists_missing_tasks_and_resubmit_uses_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "rollouts"
    args = ["--prompts", "data.jsonl", "--out", str(out)]
    _shard(out, 1, 3)
    assert generate_main([*args, "--num-shards", "3", "--status"]) == 1
    assert "2 of 3 generate tasks missing; resubmit with:\n--array=0,2" in capsys.readouterr().out
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # `python -m pipeline` of this checkout
    assert slurm_main(["resubmit", "--stage", "generate", "--num-shards", "3", "--dry-run", "--log-dir",
                       str(tmp_path / "logs"), "--", *args]) == 0
    err = capsys.readouterr().err
    assert "(submit with --array=0,2)" in err and (tmp_path / "logs" / "gkd-generate.sbatch").exists(), err
    for shard in (0, 2):
        _shard(out, shard, 3)
    assert generate_main([*args, "--num-shards", "3", "--status"]) == 0
    assert "all 3 generate tasks" in capsys.readouterr().out
