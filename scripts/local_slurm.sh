#!/usr/bin/env bash
# A throw-away single-node Slurm for trying `gkd slurm ...` / `make slurm-score` on a laptop or CI box (root, Debian).
#
#   eval "$(scripts/local_slurm.sh start)"     # installs the packages if needed, starts, exports SLURM_CONF
#   scripts/local_slurm.sh status
#   scripts/local_slurm.sh stop                # stops exactly the daemons started under the directory
#
# The directory (conf, state, logs, munge key) defaults to runs/slurm-local; pass another as the second argument.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exec "$PY" -m pipeline.slurm.local_run "${1:-status}" "${2:-runs/slurm-local}"
