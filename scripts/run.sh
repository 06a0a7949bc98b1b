#!/usr/bin/env bash
# The main job on the embedded default: a local Ray cluster replaying the bundled demo traces.
# Extra arguments are Hydra overrides, e.g. `scripts/run.sh replay.mode=comms`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
status=0
tracefleet "$@" || status=$?
# The other commands (tracefleet-predict, -report, -compare, -capture, -inspect) and the Python
# API live in the venv this script made: say how to reach them (env.sh's path as you typed ours).
echo "[tracefleet] next, in your shell: source $(dirname "${BASH_SOURCE[0]}")/env.sh" \
     "(the venv's commands and 'import tracefleet'), then e.g." >&2
echo "[tracefleet]   tracefleet-predict workload=llama3_8b world_size=8" >&2
echo "[tracefleet]   tracefleet-report <run dir>" >&2
exit "$status"
