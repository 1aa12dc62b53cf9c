"""A throw-away single-node Slurm for tests and laptops, the entry (the cluster itself is pipeline/slurm/local.py
`LocalSlurm`).

    python -m pipeline.slurm.local_run install                    # the Debian packages
    python -m pipeline.slurm.local_run start runs/slurm-local     # prints `export SLURM_CONF=...`
    python -m pipeline.slurm.local_run stop runs/slurm-local      # stops exactly the daemons started there
    python -m pipeline.slurm.local_run status runs/slurm-local    # exit 1 if nothing runs there
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.slurm.local import LocalSlurm, SlurmUnavailable, ensure_installed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.slurm.local_run", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["install", "start", "stop", "status"])
    ap.add_argument("root", nargs="?", default="runs/slurm-local")
    a = ap.parse_args(argv)
    cluster = LocalSlurm(Path(a.root).resolve())
    try:
        if a.action == "install":
            print(f"installed in {ensure_installed():.1f} s")
        elif a.action == "start":
            cluster.start()
            print(f"export SLURM_CONF={cluster.conf}")
        elif a.action == "stop":
            cluster.stop()
        else:
            up = cluster.running()
            print(f"running: {', '.join(up) or 'nothing'}; node {cluster.node_state() or '-'}")
            return 0 if up else 1
    except SlurmUnavailable as e:
        print(f"local slurm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
