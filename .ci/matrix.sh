#!/usr/bin/env bash
# Release-pair matrix: megatron-core 0.14 .. 0.19, each with the Megatron-Bridge release it ships with.
#
#   .ci/matrix.sh                 set up (or reuse) every cell and run its tests
#   .ci/matrix.sh core0182 ...    only these cells
#   MATRIX_SETUP_ONLY=1 .ci/matrix.sh     install, run nothing
#   MATRIX_PYTEST_ARGS="-x -k plugin"     extra pytest arguments
#
# Disk is the constraint, not time: the only cp312 torch reachable here is PyPI's CUDA build (5.4 GB).
# So each Python version gets ONE base venv (.venv-matrix-py3.x: torch, pytest, the plugin -e), and a
# cell is only its megatron-core + numpy + megatron-bridge in .matrix/<cell> (pip --no-deps --target,
# ~60 MB), put first on PYTHONPATH when that cell's tests run. Both are rebuilt only when their pinned
# requirements change. pip's wheel cache is off: it would keep a second copy of the CUDA wheels.
# The tests read MXFP8_BRIDGE_LOOP to replay that Bridge release's train/eval/save order
# (tests/harness/bridge_loop.py) and MXFP8_MATRIX_CELL to assert exactly the defects UPSTREAM.md lists.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

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
# Cells whose Bridge release also runs its own pretrain() (tests/bridge_real/test_bridge_real.py, and
# test_verify_real.py: the weight check at every eval, test, save - Bridge >= 0.5 has the save hook -
# and train end through the launcher): the pairs users run.
# Their extra packages (transformers, nvidia-modelopt, ...) are in the 3.12 base venv. The 4-rank
# pipeline-parallel run (PP=2 x DP=2, VP=2) and the defect-F resume comparison with real torch_dist
# checkpoints (tests/bridge_real/test_resume_real.py, three launches) run in the main tier only, to
# keep CI time; the cells' own resume job (test_bridge_real's resume run) still asserts per event
# what the plugin does after a load (re-derive where F bites, nothing on Bridge 0.6).
declare -A REAL_PRETRAIN=([core0171]=1 [core0182]=1 [core0192]=1)
# Cells whose release-order, verifier and exit-save tests run a second time with the kit's TE-shaped
# MXFP8 param (MXFP8_PARAM_KIND=te: codes and scales in both directions, a _quantizer), so the
# Transformer Engine branches of core and of the plugin run in CI: the newest pair here, core 0.16.1
# in the main tier (Makefile test-main); a subset, for CI time.
declare -A TE_PASS=([core0161]=1 [core0192]=1)
TE_PASS_TESTS="tests/ranks/test_matrix.py tests/ranks/test_weights.py tests/ranks/test_sampling.py tests/ranks/test_replica.py tests/ranks/test_ensure.py tests/ranks/test_exit_saves.py"
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

pip_q() { "$@" -q 2>&1 | grep -v -E "^WARNING: Location '.*' is ignored" || true; }

disk() { df -h . | awk 'NR==2 {print "disk: " $4 " free of " $2}'; }

setup_base() {  # $1 = 3.11 | 3.12
    local pyver=$1 venv=.venv-matrix-py$1 req=requirements/matrix-py$1.txt hash stamp py t0
    hash=$(cat "$req" pyproject.toml | sha1sum | cut -c1-12)
    stamp=$venv/.installed-$hash
    [ -f "$stamp" ] && return 0
    t0=$SECONDS
    py=$(find_python "$pyver")
    rm -rf "$venv"
    "$py" -m venv "$venv"
    echo "[py$pyver] installing $req into $venv ($(disk))"
    pip_q "$venv/bin/python" -m pip install -r "$req"
    pip_q flock .venv-editable.lock "$venv/bin/python" -m pip install --no-deps -e .
    PYTHONWARNINGS=ignore "$venv/bin/python" -c "import torch, pytest, yaml" \
        || { echo "[py$pyver] base install incomplete ($(disk))" >&2; return 1; }
    touch "$stamp"
    echo "[py$pyver] base venv ready in $((SECONDS - t0)) s, $(du -sh "$venv" | cut -f1) ($(disk))"
}

setup_real() {  # $1 = 3.12: what Bridge's own pretrain() imports, once per base venv (own stamp, so
    # changing it never reinstalls torch). requirements/bridge-real-py$1.txt says what and why.
    local pyver=$1 venv=.venv-matrix-py$1 req=requirements/bridge-real-py$1.txt hash stamp t0
    hash=$(sha1sum < "$req" | cut -c1-12)
    stamp=$venv/.installed-real-$hash
    [ -f "$stamp" ] && return 0
    t0=$SECONDS
    echo "[py$pyver] installing $req into $venv ($(disk))"
    pip_q "$venv/bin/python" -m pip install -r "$req"
    PYTHONWARNINGS=ignore "$venv/bin/python" -c "import transformers, modelopt, tensorboard, psutil, einops" \
        || { echo "[py$pyver] real-pretrain packages incomplete ($(disk))" >&2; return 1; }
    rm -f "$venv"/.installed-real-* && touch "$stamp"
    echo "[py$pyver] real-pretrain packages ready in $((SECONDS - t0)) s, $(du -sh "$venv" | cut -f1) ($(disk))"
}

setup_cell() {
    local cell=$1 pyver=${CELL[$1]% *} dir=.matrix/$1 req=requirements/$1.txt hash stamp
    setup_base "$pyver" || return 1
    if [ -n "${REAL_PRETRAIN[$cell]:-}" ]; then setup_real "$pyver" || return 1; fi
    hash=$(cat "$req" | sha1sum | cut -c1-12)
    stamp=$dir/.installed-$hash
    if [ -f "$stamp" ]; then
        echo "[$cell] reusing $dir"
        return 0
    fi
    rm -rf "$dir"
    pip_q ".venv-matrix-py$pyver/bin/python" -m pip install --no-deps --target "$dir" -r "$req"
    # pip only warns on some failures through grep above; verify the result.
    PYTHONPATH=$dir PYTHONWARNINGS=ignore NO_VCS_VERSION=1 ".venv-matrix-py$pyver/bin/python" \
        -c "import torch, numpy, megatron.core, mbridge_mxfp8_plugin" \
        || { echo "[$cell] install incomplete ($(disk))" >&2; return 1; }
    touch "$stamp"
    echo "[$cell] $req in $dir ($(du -sh "$dir" | cut -f1))"
}

declare -A RESULT
declare -A SECS
fail=0
echo "matrix: cells ${cells[*]}; $(disk)"
for cell in "${cells[@]}"; do
    [ -n "${CELL[$cell]:-}" ] || { echo "unknown cell $cell (known: ${ORDER[*]})" >&2; exit 2; }
    loop=${CELL[$cell]#* }
    py=.venv-matrix-py${CELL[$cell]% *}/bin/python
    t0=$SECONDS
    if ! setup_cell "$cell"; then
        RESULT[$cell]="SETUP FAILED"; fail=1; continue
    fi
    if [ -n "${MATRIX_SETUP_ONLY:-}" ]; then
        RESULT[$cell]="set up"; SECS[$cell]=$((SECONDS - t0)); continue
    fi
    versions=$(PYTHONPATH=.matrix/$cell NO_VCS_VERSION=1 "$py" -c "
from importlib.metadata import version as v
import sys
print(f'python {sys.version.split()[0]}  torch {v(\"torch\")}  megatron-core {v(\"megatron-core\")}  megatron-bridge {v(\"megatron-bridge\")}')")
    echo
    echo "=================================================================================="
    echo "[$cell] $versions"
    echo "[$cell] Bridge loop order replayed: $loop"
    echo "=================================================================================="
    # What each cell runs is marked in the tests themselves (pytest.mark.matrix), not listed here.
    # shellcheck disable=SC2086
    if PYTHONPATH=.matrix/$cell MXFP8_MATRIX_CELL=$cell MXFP8_BRIDGE_LOOP=$loop NO_VCS_VERSION=1 \
        "$py" -m pytest -q -p no:cacheprovider -m matrix tests/unit tests/ranks ${MATRIX_PYTEST_ARGS:-}; then
        RESULT[$cell]="passed"
    else
        RESULT[$cell]="FAILED"; fail=1
    fi
    if [ -n "${TE_PASS[$cell]:-}" ]; then
        t1=$SECONDS
        echo "[$cell] again with the TE-shaped MXFP8 param (MXFP8_PARAM_KIND=te)"
        # The verifier's fused kernel off here (the main tier's TE-shaped pass runs it): every TE-shaped
        # check goes through the type's own write path.
        # shellcheck disable=SC2086
        if PYTHONPATH=.matrix/$cell MXFP8_MATRIX_CELL=$cell MXFP8_BRIDGE_LOOP=$loop MXFP8_PARAM_KIND=te MXFP8_VERIFY_FUSED=0 \
            NO_VCS_VERSION=1 "$py" -m pytest -q -p no:cacheprovider -m matrix $TE_PASS_TESTS \
            ${MATRIX_PYTEST_ARGS:-}; then
            RESULT[$cell]="${RESULT[$cell]}, TE-shaped param passed ($((SECONDS - t1)) s)"
        else
            RESULT[$cell]="${RESULT[$cell]}, TE-shaped param FAILED"; fail=1
        fi
    fi
    if [ -n "${REAL_PRETRAIN[$cell]:-}" ]; then
        t1=$SECONDS
        echo "[$cell] Megatron-Bridge's real pretrain() ($(disk))"
        # shellcheck disable=SC2086
        if PYTHONPATH=.matrix/$cell MXFP8_MATRIX_CELL=$cell MXFP8_REAL_BRIDGE=require NO_VCS_VERSION=1 \
            "$py" -m pytest -q -p no:cacheprovider tests/bridge_real/test_bridge_real.py \
            tests/bridge_real/test_verify_real.py -k "not pipeline" \
            ${MATRIX_PYTEST_ARGS:-}; then
            RESULT[$cell]="${RESULT[$cell]}, real pretrain passed ($((SECONDS - t1)) s)"
        else
            RESULT[$cell]="${RESULT[$cell]}, real pretrain FAILED"; fail=1
        fi
    fi
    SECS[$cell]=$((SECONDS - t0))
    RESULT[$cell]="${RESULT[$cell]}  ($versions)"
done

echo
echo "matrix summary (total ${SECONDS} s, $(disk)):"
for cell in "${cells[@]}"; do
    printf '  %-9s loop %-6s %4s s  %s\n' "$cell" "${CELL[$cell]#* }" "${SECS[$cell]:-?}" "${RESULT[$cell]:-not run}"
done
exit $fail
