"""The sbatch scripts and CLI of `gkd slurm`, without Slurm: the rendered scripts run under bash with stand-ins for
python/srun/scontrol that record what they were asked to run.

    pytest tests/slurm/test_sbatch.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.slurm.arrays import array_spec
from pipeline.slurm.queue import SlurmError, missing_shards, parse_array
from pipeline.slurm.sbatch import SbatchOptions, array_script, train_script

RECORD = """#!/bin/bash
# records its argv (and the node id it ran on) as one JSON line
{py} -c 'import json, os, sys; print(json.dumps({{"argv": sys.argv[1:], "node": os.environ.get("SLURM_NODEID")}}))' "$@" >> {out}
"""


def _fake(bin_dir: Path, name: str, body: str) -> Path:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(body)
    path.chmod(0o755)
    return path


def _opts(tmp_path, **kw) -> SbatchOptions:
    return SbatchOptions(job_name="gkd-score", log_dir=tmp_path / "logs", chdir=tmp_path, **kw)


def test_array_script_runs_the_shard_command(tmp_path):
    out = tmp_path / "calls.jsonl"
    python = _fake(tmp_path / "bin", "python", RECORD.format(py=sys.executable, out=out))
    text = array_script("score", ["--cache", "my cache", "topk=4"], 4, _opts(tmp_path, cpus_per_task=2), str(python))
    assert "#SBATCH --array=0-3" in text and "#SBATCH --requeue" in text and "#SBATCH --cpus-per-task=2" in text
    assert f"#SBATCH --output={tmp_path}/logs/gkd-score-%A_%a.log" in text
    script = tmp_path / "s.sbatch"
    script.write_text(text)
    # a resubmitted single index: Slurm says the array has 1 task, the script still passes the total of 4
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "1", "SLURM_ARRAY_JOB_ID": "7",
           "SLURM_JOB_ID": "9", "SLURM_CPUS_PER_TASK": "2"}
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "[slurm] task 7_2 (job 9)" in res.stdout
    call = json.loads(out.read_text())
    assert call["argv"] == ["-m", "pipeline", "score", "--cache", "my cache", "topk=4", "--shard", "2", "--num-shards", "4"]


def test_stage_args_must_not_set_the_shard():
    for bad in (["--shard", "1"], ["--num-shards=3"], ["num_shards=3"]):
        with pytest.raises(ValueError, match="launcher passes"):
            array_script("score", bad, 2, SbatchOptions("j", Path("l"), Path(".")))


def test_train_script_starts_torchrun_per_node(tmp_path):
    """Two nodes x 4 GPUs: one torchrun per node, node rank from that node's SLURM_NODEID, rendezvous on the head."""
    out = tmp_path / "calls.jsonl"
    bin_dir = tmp_path / "bin"
    python = _fake(bin_dir, "python", RECORD.format(py=sys.executable, out=out))
    _fake(bin_dir, "scontrol", "#!/bin/bash\nprintf 'gpu-a7\\ngpu-b3\\n'\n")
    # srun stand-in: drop its options, run the command once per node with that node's SLURM_NODEID
    _fake(bin_dir, "srun", '#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n'
                           'for n in 0 1; do SLURM_NODEID=$n "$@" || exit 1; done\n')
    text = train_script(["--config", "c.yaml", "lr=1e-4"], SbatchOptions("gkd-train", tmp_path, tmp_path),
                        nodes=2, gpus_per_node=4, python=str(python))
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text and "#SBATCH --ntasks-per-node=1" in text
    script = tmp_path / "t.sbatch"
    script.write_text(text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "1234", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "gpu-[a7,b3]"}
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    calls = [json.loads(line) for line in out.read_text().splitlines()]
    assert [c["node"] for c in calls] == ["0", "1"]
    for rank, c in enumerate(calls):
        assert c["argv"] == ["-m", "torch.distributed.run", f"--node-rank={rank}", "--nnodes=2", "--nproc-per-node=4",
                             "--rdzv-backend=c10d", "--rdzv-endpoint=gpu-a7:30734", "--rdzv-id=1234",
                             "-m", "pipeline.train.run", "--config", "c.yaml", "lr=1e-4"]


def test_nproc_defaults(tmp_path):
    opts = SbatchOptions("t", tmp_path, tmp_path)
    assert "--nproc-per-node=1 " in train_script([], opts)  # CPU
    assert "--nproc-per-node=8 " in train_script([], opts, gpus_per_node=8)
    assert "--nproc-per-node=2 " in train_script([], opts, gpus_per_node=8, nproc_per_node=2)
    assert "PORT=29600\n" in train_script([], opts, port=29600)
    assert "gpus-per-node" not in train_script([], opts)


def test_array_specs_round_trip():

    for idx in ([0], [0, 1, 2, 5, 7, 8], [3], [1, 3, 4, 5, 9]):
        assert parse_array(array_spec(idx)) == idx
    assert parse_array("0-3%2") == [0, 1, 2, 3]


def test_missing_shards_parses_the_stage_status(tmp_path):
    def stage(rc: int, text: str) -> str:
        return str(_fake(tmp_path / "bin", f"py{rc}", f"#!/bin/bash\necho '{text}'\nexit {rc}\n"))

    assert missing_shards("score", [], 8, python=stage(1, "2 of 8 missing; resubmit with:\n--array=1,3-4")) == [1, 3, 4]
    assert missing_shards("score", [], 8, python=stage(0, "all done")) == []
    with pytest.raises(SlurmError, match="exit 2"):
        missing_shards("generate", [], 8, python=stage(2, "unrecognized arguments: --status"))


def _gkd(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "pipeline", "slurm", *argv], capture_output=True, text=True, cwd=cwd)


def test_cli_dry_run_writes_deterministic_script(tmp_path):
    res = _gkd("score", "--num-shards", "3", "--dry-run", "--extra-sbatch", "--qos=high --account=p", "--", "--cache",
               "c", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout == "", res.stderr
    script = tmp_path / "runs" / "slurm" / "gkd-score.sbatch"
    text = script.read_text()
    assert "#SBATCH --qos=high\n#SBATCH --account=p\n" in text and f"#SBATCH --chdir={tmp_path}" in text
    # deterministic: the same command writes the same bytes again (no date, pid or random name in the script),
    # and from another folder the same script but for that folder
    script.unlink()
    again = _gkd("score", "--num-shards", "3", "--dry-run", "--extra-sbatch", "--qos=high --account=p", "--",
                 "--cache", "c", cwd=tmp_path)
    assert again.returncode == 0 and script.read_text() == text, again.stderr
    other = tmp_path / "other"
    other.mkdir()
    assert _gkd("score", "--num-shards", "3", "--dry-run", "--extra-sbatch", "--qos=high --account=p", "--",
                "--cache", "c", cwd=other).returncode == 0
    assert (other / "runs" / "slurm" / "gkd-score.sbatch").read_text() == text.replace(str(tmp_path), str(other))
    bad = _gkd("generate", "--num-shards", "3", "--array", "2-3", "--dry-run", cwd=tmp_path)
    assert bad.returncode == 2 and "outside [0, 3)" in bad.stderr
    clash = _gkd("score", "--num-shards", "3", "--dry-run", "--", "--shard", "1", cwd=tmp_path)
    assert clash.returncode == 2 and "launcher passes" in clash.stderr
