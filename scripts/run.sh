#!/usr/bin/env bash
# The main job on the embedded default: a local Ray cluster replaying the bundled demo traces.
# Extra arguments are Hydra overrides, e.g. `scripts/run.sh replay.mode=comms`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec tracefleet "$@"
