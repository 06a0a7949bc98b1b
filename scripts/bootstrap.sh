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
# torchvision (its models, for the ecosystem captures' tests) matching the installed torch:
# 0.<minor+15>.<patch> for torch 2.<minor>.<patch>, with --no-deps so it never brings another
# torch. PyPI's wheel links CUDA, and beside a CPU torch its C ops do not load ("operator
# torchvision::nms does not exist"); its models are pure Python and import when the two
# modules registering those ops' meta/autograd kernels are pre-registered empty: only then is
# a .pth shim doing that dropped into the venv's site-packages (docs/capture.md).
SHIM=tracefleet_torchvision_shim.pth
install_torchvision() {
    local spec site
    spec="$("$VENV/bin/python" -c 'import re, torch
m = re.match(r"2\.(\d+)\.(\d+)", torch.__version__)
print(f"torchvision==0.{int(m[1]) + 15}.{m[2]}" if m else "")')"
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -f "$site/$SHIM"
    if [ -z "$spec" ] || ! "$VENV/bin/python" -m pip install -q --no-deps "$spec" >&2; then
        echo "[tracefleet] torchvision not installed (${spec:-no match for this torch}): its tests skip" >&2
        return 0
    fi
    local failure
    failure="$("$VENV/bin/python" -c "import torchvision" 2>&1 || true)"
    if [[ "$failure" == *"torchvision::nms does not exist"* ]]; then
        local m="torchvision._meta_registrations" a="torchvision._autograd_registrations"
        echo "import sys, types; sys.modules.setdefault('$m', types.ModuleType('$m')); sys.modules.setdefault('$a', types.ModuleType('$a'))" > "$site/$SHIM"
        if "$VENV/bin/python" -c "import torchvision.models" >/dev/null 2>&1; then
            echo "[tracefleet] $spec: C ops unavailable beside this torch; models only ($site/$SHIM)" >&2
        else
            rm -f "$site/$SHIM"
            echo "[tracefleet] $spec does not import beside this torch: its tests skip" >&2
        fi
    fi
}
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
    install_torchvision
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# DeepSpeed JIT-builds ops; keep them in a cache of our own so other envs don't clobber it.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/tracefleet/torch_extensions}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
