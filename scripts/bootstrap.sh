#!/usr/bin/env bash
# Create .venv and install tracefleet into it if missing. Sourced by run.sh and test.sh.
# torch is installed first and pinned, so the project's "torch>=2.5" never pulls a
# multi-GB CUDA build. A GPU user sets TRACEFLEET_TORCH_SPEC (e.g. "torch==2.5.1+cu124"
# with PIP_EXTRA_INDEX_URL) or TRACEFLEET_TORCH_SPEC=skip to keep the torch already present.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRACEFLEET_VENV:-$ROOT/.venv}"
TORCH_SPEC="${TRACEFLEET_TORCH_SPEC:-torch==2.13.0}"
STAMP="$VENV/.tracefleet-installed"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[tracefleet] creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
# Reinstall when pyproject.toml changed since the last install.
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    echo "[tracefleet] installing into $VENV (torch first: $TORCH_SPEC)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    if [ "$TORCH_SPEC" != "skip" ]; then
        "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" >&2
    fi
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]" >&2
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# DeepSpeed JIT-builds ops; keep them in a cache of our own so other envs don't clobber it.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/tracefleet/torch_extensions}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
