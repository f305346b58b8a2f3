#!/usr/bin/env bash
# Everything about todevice that needs a CUDA GPU, in one call: bench/gpu_check.py's steps, into OUT/gpu-check.json.
#
#   bash bench/gpu_check.sh [OUT] [-- gpu_check.py's options: --probes DIR, --budget SECONDS, --only STEP,...]
#
# Run from the repository root. The checkout's src/ is imported, not an installed todevice. Where optree is not
# installed, WHEELS=DIR names a folder holding its wheel, installed into a folder of its own first.
set -u
out=gpu-check
if [ $# -gt 0 ] && [ "$1" != "--" ]; then out=$1; shift; fi
[ "${1:-}" = "--" ] && shift
export PYTHONUNBUFFERED=1
if ! python3 -c "import optree" 2>/dev/null; then
    if [ -z "${WHEELS:-}" ]; then
        echo "optree is not installed: name a folder holding its wheel in WHEELS" >&2
        exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/todevice-site "$WHEELS"/*.whl || exit 2
    export PYTHONPATH=/tmp/todevice-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
exec python3 bench/gpu_check.py --out "$out" "$@"
