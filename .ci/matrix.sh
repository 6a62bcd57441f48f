#!/usr/bin/env bash
# Release-pair matrix: megatron-core 0.14 .. 0.19, each with the Megatron-Bridge release it ships with.
#
#   .ci/matrix.sh                 set up (or reuse) every cell's venv and run its tests
#   .ci/matrix.sh core0182 ...    only these cells
#   MATRIX_SETUP_ONLY=1 .ci/matrix.sh     build the venvs, run nothing
#   MATRIX_PYTEST_ARGS="-x -k plugin"     extra pytest arguments
#
# One venv per cell at the repo root (.venv-<cell>, ignored by git), rebuilt only when its pinned
# requirements (requirements/<cell>.txt + <cell>-nodeps.txt) or pyproject.toml change. The tests read
# MXFP8_BRIDGE_LOOP to replay that Bridge release's train/eval/save order (testing/bridge_loop.py)
# and MXFP8_MATRIX_CELL to assert exactly the defects UPSTREAM.md lists for the pair.
set -euo pipefail
cd "$(dirname "$0")/.."

# cell -> "python bridge-loop"
declare -A CELL=(
    [core0140]="3.11 0.3.1"
    [core0153]="3.11 0.3.1"
    [core0161]="3.11 0.3.1"
    [core0171]="3.12 0.4.2"
    [core0182]="3.12 0.5.1"
    [core0192]="3.12 0.6.2"
)
ORDER=(core0140 core0153 core0161 core0171 core0182 core0192)
cells=("$@")
[ ${#cells[@]} -eq 0 ] && cells=("${ORDER[@]}")

find_python() {  # $1 = 3.11 | 3.12
    local v=$1 c
    for c in "python$v" "/root/.pyenv/versions/$v"*/bin/"python$v"; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys, venv' 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    echo "matrix: no python$v found (needed for megatron-core wheels of this cell)" >&2
    return 1
}

pip_q() { "$@" --disable-pip-version-check -q 2>&1 | grep -v -E "^WARNING: Location '.*' is ignored" || true; }

setup_cell() {
    local cell=$1 pyver=${CELL[$cell]% *} venv=.venv-$1 req=requirements/$1.txt nodeps=requirements/$1-nodeps.txt
    local hash stamp py t0
    hash=$(cat "$req" "$nodeps" pyproject.toml | sha1sum | cut -c1-12)
    stamp=$venv/.installed-$hash
    if [ -f "$stamp" ]; then
        echo "[$cell] reusing $venv"
        return 0
    fi
    t0=$SECONDS
    py=$(find_python "$pyver")
    rm -rf "$venv"
    "$py" -m venv "$venv"
    echo "[$cell] installing $req into $venv (python $pyver)"
    pip_q "$venv/bin/python" -m pip install -r "$req"
    pip_q "$venv/bin/python" -m pip install --no-deps -r "$nodeps"
    pip_q "$venv/bin/python" -m pip install --no-deps -e .
    # pip only warns on a failed --no-deps step through grep above; verify the result.
    PYTHONWARNINGS=ignore NO_VCS_VERSION=1 "$venv/bin/python" -c "import torch, megatron.core, mbridge_mxfp8_plugin" \
        || { echo "[$cell] install incomplete" >&2; return 1; }
    touch "$stamp"
    echo "[$cell] venv ready in $((SECONDS - t0)) s"
}

declare -A RESULT
declare -A SECS
fail=0
for cell in "${cells[@]}"; do
    [ -n "${CELL[$cell]:-}" ] || { echo "unknown cell $cell (known: ${ORDER[*]})" >&2; exit 2; }
    loop=${CELL[$cell]#* }
    t0=$SECONDS
    if ! setup_cell "$cell"; then
        RESULT[$cell]="SETUP FAILED"; fail=1; continue
    fi
    if [ -n "${MATRIX_SETUP_ONLY:-}" ]; then
        RESULT[$cell]="set up"; SECS[$cell]=$((SECONDS - t0)); continue
    fi
    versions=$(NO_VCS_VERSION=1 ".venv-$cell/bin/python" -c "
from importlib.metadata import version as v
import sys
print(f'python {sys.version.split()[0]}  torch {v(\"torch\")}  megatron-core {v(\"megatron-core\")}  megatron-bridge {v(\"megatron-bridge\")}')")
    echo
    echo "=================================================================================="
    echo "[$cell] $versions"
    echo "[$cell] Bridge loop order replayed: $loop"
    echo "=================================================================================="
    # shellcheck disable=SC2086
    if MXFP8_MATRIX_CELL=$cell MXFP8_BRIDGE_LOOP=$loop NO_VCS_VERSION=1 \
        ".venv-$cell/bin/python" -m pytest -q -p no:cacheprovider tests/test_matrix.py tests/test_doctor.py \
        "tests/test_validate.py::test_bucket_alignment_on_real_dense_and_expert_buffers" ${MATRIX_PYTEST_ARGS:-}; then
        RESULT[$cell]="passed"
    else
        RESULT[$cell]="FAILED"; fail=1
    fi
    SECS[$cell]=$((SECONDS - t0))
    RESULT[$cell]="${RESULT[$cell]}  ($versions)"
done

echo
echo "matrix summary (total ${SECONDS} s):"
for cell in "${cells[@]}"; do
    printf '  %-9s loop %-6s %4s s  %s\n' "$cell" "${CELL[$cell]#* }" "${SECS[$cell]:-?}" "${RESULT[$cell]:-not run}"
done
exit $fail
