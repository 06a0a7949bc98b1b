# Put tracefleet in this shell: `source scripts/env.sh` (from any directory; bash or zsh).
# Creates .venv first if it is missing (scripts/bootstrap.sh, as run.sh and test.sh do), then
# activates it: tracefleet, tracefleet-predict, -report, -compare, -inspect, -capture and
# `python -c 'import tracefleet'` work here until `deactivate`.
# bootstrap.sh runs `set -euo pipefail`: it runs in a child bash so that neither those options
# nor an error can reach (or close) your shell; only its results come back. A failure returns 1.
if [ -n "${BASH_VERSION:-}" ]; then
    _tf_src="${BASH_SOURCE[0]}"
    if [ "$_tf_src" = "$0" ]; then
        echo "scripts/env.sh: source it, don't run it: source $0" >&2
        exit 1
    fi
elif [ -n "${ZSH_VERSION:-}" ]; then
    eval '_tf_src="${(%):-%x}"'
else
    echo "scripts/env.sh: needs bash or zsh (in another shell: source .venv/bin/activate)" >&2
    return 1
fi
# (no `|| ...` after its `source`: that would switch bootstrap.sh's set -e off)
_tf_env="$(bash -c 'source "$1" >&2
printf "_tf_venv=%q; export TORCH_EXTENSIONS_DIR=%q DS_ACCELERATOR=%q\n" \
    "$VENV" "$TORCH_EXTENSIONS_DIR" "$DS_ACCELERATOR"' \
    env.sh "$(CDPATH='' cd -- "$(dirname -- "$_tf_src")" && pwd)/bootstrap.sh")"
if [ $? -ne 0 ] || [ -z "$_tf_env" ]; then
    echo "[tracefleet] scripts/bootstrap.sh failed (see above); nothing activated" >&2
    unset _tf_src _tf_env
    return 1
fi
eval "$_tf_env"
if ! . "$_tf_venv/bin/activate"; then
    echo "[tracefleet] could not activate $_tf_venv" >&2
    unset _tf_src _tf_env _tf_venv
    return 1
fi
unset _tf_src _tf_env _tf_venv
