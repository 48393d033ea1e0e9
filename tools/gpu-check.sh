#!/bin/sh
# Issue 43's GPU check (tools/gpu_check.py), sized for 8 minutes on an H100/H200: the batched pass
# and the speculative loop in one process (and the pass split over 2 GPUs where there are two),
# with only torch, transformers and numpy installed plus
# the small pure-Python packages carried in .gpu-check/site (make gpu-check-site builds it here).
# Rehearse on this machine: tools/gpu-check.sh --device cpu --levels 1,4 --tokens 16 [--tp 3]
cd "$(dirname "$0")/.." || exit 1
if [ -d .gpu-check/site ]; then
    PYTHONPATH="$PWD/.gpu-check/site${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONPATH
fi
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${GPU_CHECK_SYSTEM_PYTHON:-}" ] && PYTHON=.venv/bin/python
exec timeout 480 "$PYTHON" tools/gpu_check.py "$@"
