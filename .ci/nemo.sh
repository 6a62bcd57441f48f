#!/usr/bin/env bash
# NeMo tier: the Lightning adapter on NeMo 2's real stack (tests/nemo/).
#
#   .ci/nemo.sh                      set up (or reuse) .venv-nemo and run the tier
#   NEMO_SETUP_ONLY=1 .ci/nemo.sh    install, run nothing
#   NEMO_VENV=path .ci/nemo.sh       another venv directory (e.g. to time a from-scratch install)
#
# .venv-nemo (Python 3.11) holds torch 2.13.0 (the local CPU wheel, installed first by pip and on its
# own so nothing pulls a CUDA build), then every package of requirements/nemo.txt with --no-deps: all
# pinned, no optional trees (nemo_run's and leptonai's would bring ray and skypilot). Those 176 go in
# through uv (pinned below): measured here under load, pip took ~18 min for them, uv ~30 s.
# Rebuilt only when requirements/nemo.txt or pyproject.toml change. No wheel cache (no second copy).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 NO_VCS_VERSION=1
VENV=${NEMO_VENV:-.venv-nemo}
REQ=requirements/nemo.txt
PY=$VENV/bin/python

disk() { df -h . | awk 'NR==2 {print "disk: " $4 " free of " $2}'; }
pip_q() { "$@" -q 2>&1 | grep -v -E "^WARNING: Location '.*' is ignored" || true; }

find_python() {
    local c
    for c in python3.11 /root/.pyenv/versions/3.11*/bin/python3.11; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys, venv' 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    echo "nemo: no python3.11 found (nemo_toolkit 2.7.3 + megatron-core 0.15.3 are run on 3.11)" >&2
    return 1
}

stamp=$VENV/.installed-$(cat "$REQ" pyproject.toml | sha1sum | cut -c1-12)
echo "nemo: $(disk)"
if [ ! -f "$stamp" ]; then
    t0=$SECONDS
    rm -rf "$VENV"
    "$(find_python)" -m venv "$VENV"
    echo "nemo: installing $REQ into $VENV"
    pip_q "$PY" -m pip install torch==2.13.0 uv==0.13.9
    "$PY" -m uv pip install -q --python "$PY" --no-cache --no-deps -r "$REQ"
    flock .venv-editable.lock "$PY" -m uv pip install -q --python "$PY" --no-cache --no-deps -e .
    # pip only warns on some failures through the filter above; check the result.
    PYTHONWARNINGS=ignore "$PY" -c "import nemo.lightning, nemo.collections.llm, megatron.core, pytest" \
        || { echo "nemo: install incomplete ($(disk))" >&2; exit 1; }
    touch "$stamp"
    echo "nemo: $VENV ready in $((SECONDS - t0)) s, $(du -sh "$VENV" | cut -f1) ($(disk))"
else
    echo "nemo: reusing $VENV"
fi
[ -n "${NEMO_SETUP_ONLY:-}" ] && exit 0

PYTHONWARNINGS=ignore "$PY" -c "
from importlib.metadata import version as v
import sys
print('nemo: python', sys.version.split()[0], '| ' + ' | '.join(
    f'{p} {v(p)}' for p in ('torch', 'nemo_toolkit', 'megatron-core', 'lightning', 'numpy')))"
t0=$SECONDS
"$PY" -m pytest -q -p no:cacheprovider -rs tests/nemo
echo "nemo: tier passed in $((SECONDS - t0)) s ($(disk))"
