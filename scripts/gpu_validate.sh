#!/usr/bin/env bash
# One command that checks the GPU side of the memory model on one GPU, in under 6 minutes:
# the CUDA-marked tests, the caching allocator model against max_memory_reserved/allocated of
# real training steps (each also recorded with _record_memory_history and compared with the
# predicted snapshot), the replay's time beside the original's, NCCL at world 1
# (scripts/gpu_validate.py; docs/prediction.md, "Checking on a GPU"). The last line is one
# JSON object. Without a GPU it says so in one line and exits 0. Extra arguments go to the
# Python script (--out DIR, --skip-tests, --budget-s S).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" \
    2>/dev/null || status=$?
if [ "$status" = 3 ]; then
    echo "gpu_validate: no CUDA GPU here (torch.cuda.is_available() is False): nothing to run"
    exit 0
elif [ "$status" != 0 ]; then
    echo "gpu_validate: $PYTHON cannot import torch (scripts/bootstrap.sh installs it)" >&2
    exit 2
fi
exec timeout 420 "$PYTHON" scripts/gpu_validate.py "$@"
