"""Shared test set-up: helper modules on sys.path, and the session's throw-away local Slurm.

`slurm_cluster` (pipeline/slurm/local.py), for the `slurm`-marked tests of tests/slurm and tests/onpolicy, is started
once per session:

    pytest -m slurm tests/slurm tests/onpolicy -s        # -s shows how long the package install and the start took

It installs Debian's slurmctld/slurmd/slurm-client/munge when missing (root + apt-get), so CI needs nothing else;
where that is impossible the tests skip with the reason. Teardown stops exactly the daemons it started, by their pid
files. Client commands (also those the `gkd slurm` subprocesses and the jobs run) find the cluster via $SLURM_CONF.
"""

import os
import sys
import time
from pathlib import Path

import pytest

# The Ray tests' clusters listen on 127.0.0.1 only. Ray reads this when it is first imported, and vLLM imports Ray
# in whichever test first opens an engine, long before tests/ray runs: so it is set here, before anything else.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Shared test helpers (tests/scored_rows.py, tests/tiny_models.py) are imported by plain name.
sys.path.insert(0, str(Path(__file__).parent))

from pipeline.slurm.local import LocalSlurm, SlurmUnavailable, ensure_installed  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def fingerprint_records(tmp_path_factory):
    """Fingerprint records (pipeline/store/weights.py) of the session's models go to a session folder, not the
    user's ~/.cache; set in os.environ so the CLI subprocesses of the tests use it too."""
    before = os.environ.get("GKD_FINGERPRINT_DIR")
    os.environ["GKD_FINGERPRINT_DIR"] = str(tmp_path_factory.mktemp("fingerprints"))
    yield Path(os.environ["GKD_FINGERPRINT_DIR"])
    if before is None:
        os.environ.pop("GKD_FINGERPRINT_DIR", None)
    else:
        os.environ["GKD_FINGERPRINT_DIR"] = before


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    try:
        t0 = time.time()
        installed = ensure_installed()
        cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
        cluster.start()
    except SlurmUnavailable as e:
        pytest.skip(f"no local Slurm: {e}")
    print(f"\n[slurm] install {installed:.1f} s, install+start {time.time() - t0:.1f} s, root {cluster.root}",
          file=sys.stderr)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in cluster.env().items():
            mp.setenv(k, v)
        try:
            yield cluster
        finally:
            cluster.stop()
