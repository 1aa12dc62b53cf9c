"""The session's Ray cluster for tests/ray: one single-machine cluster on 127.0.0.1, started by this test process
(`ray.init`) and stopped by it (`ray.shutdown()` ends its GCS, raylet and workers). `gkd ray` subprocesses join it
by its GCS address; the on-policy tests, running in this process, use the connection directly.

    pytest tests/ray -s        # -s shows the start-up time
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "onpolicy"))  # onpolicy_helpers, shared by name


@pytest.fixture(scope="session")
def ray_cluster():
    with pytest.MonkeyPatch.context() as mp:
        # loopback only (pipeline/ray/cluster.py); Ray reads it at import
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setenv("RAY_DISABLE_USAGE_STATS", "1")
        # Ray runs its workers at nice 15 (docs/dependencies.md, "Ray"): beside `make test-loaded`'s busy processes
        # at nice 0 they got a few % of the CPU (a test took 699 s). At 0 they share the cores as every other test's
        # processes do, so the loaded run loads them as much as the rest, no more.
        mp.setenv("RAY_worker_niceness", "0")
        ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
        from pipeline.ray.cluster import runtime_env

        t0 = time.time()
        ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env(), log_to_driver=True)
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:"), address
        print(f"\n[ray] cluster at {address} started in {time.time() - t0:.1f} s (pid {os.getpid()})", file=sys.stderr)
        try:
            yield address
        finally:
            ray.shutdown()
