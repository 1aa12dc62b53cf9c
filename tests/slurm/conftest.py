"""A throw-away single-node Slurm for the `slurm`-marked tests, started once per session (pipeline/slurm/local.py).

    pytest -m slurm tests/slurm -s        # -s shows how long the package install and the start took

The fixture installs Debian's slurmctld/slurmd/slurm-client/munge when missing (root + apt-get), so CI needs nothing
else; where that is impossible the tests skip with the reason. Teardown stops exactly the daemons it started, by
their pid files. Client commands (also those the `gkd slurm` subprocesses run) find the cluster via $SLURM_CONF.
"""

import sys
import time

import pytest

from pipeline.slurm.local import LocalSlurm, SlurmUnavailable, ensure_installed


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
