#!/usr/bin/env bash
# Lint tier of CI: ruff and mypy on a clean clone, in the main venv (`make test` builds it).
# mypy checks against the lowest supported Python (pyproject's [tool.mypy] python_version).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
[ -x "$PY" ] || { echo "lint: $PY not found; run 'make test' (or make demo) first to build $VENV" >&2; exit 2; }
"$PY" -m pip install -q --disable-pip-version-check ruff==0.17.6 mypy==2.4.1 types-PyYAML==6.0.12.20261122
echo "ruff $("$PY" -m ruff --version | cut -d' ' -f2), mypy $("$PY" -m mypy --version | cut -d' ' -f2)"
# benchmarks/ and docs/render.py too: they are the code behind every committed number and table
"$PY" -m ruff check mbridge_mxfp8_plugin tests benchmarks docs/render.py
"$PY" -m ruff format --check mbridge_mxfp8_plugin tests benchmarks docs/render.py
"$PY" -m mypy mbridge_mxfp8_plugin
