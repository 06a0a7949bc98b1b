#!/usr/bin/env bash
# Run the test suite (CPU; CUDA tests skip without a GPU). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
exec python -m pytest -q "$@"
