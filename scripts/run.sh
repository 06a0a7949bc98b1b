#!/usr/bin/env bash
# The main job on the embedded default: a local Ray cluster replaying the bundled demo traces.
# Extra arguments are Hydra overrides, e.g. `scripts/run.sh replay.mode=comms`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
status=0
tracefleet "$@" || status=$?
# The other commands (tracefleet-predict, -report, -compare, -capture, -inspect) and the Python
# API live in the venv this script made: say how to reach them.
echo "[tracefleet] the other commands and the Python API are in $VENV/bin:" \
     "run 'source $VENV/bin/activate' first (or call $VENV/bin/tracefleet-predict ...)" >&2
exit "$status"
