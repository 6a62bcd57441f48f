#!/usr/bin/env bash
# `make test`: the fast tier, lint, the main suite, the release matrix and the NeMo tier, in that order.
#
# The matrix and NeMo virtualenvs (~10 GB, two Python versions, a CUDA torch wheel) are installed in
# the background while lint and the main suite run: installing waits on the network and the disk, the
# suite on the CPU, and done one after the other they were a quarter of a CI run. Each tier still
# runs even when an earlier one failed (one CI run reports every failure); the exit code is non-zero
# if any failed. Install logs: $CI_LOGS (default .ci-logs/), printed in full when an install fails.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${CI_LOGS:-.ci-logs}
mkdir -p "$LOGS"
MAKE=${MAKE:-make}
failed=()
times=()  # "name seconds status" per tier, printed as a table at the end

phase() { printf '\n########## %s  (t=%d s, %s)\n' "$1" "$SECONDS" "$(df -h . | awk 'NR==2 {print $4 " disk free"}')"; }
tier() {  # $1 = name, rest = command
    local name=$1 t0=$SECONDS; shift
    phase "$name"
    if "$@"; then echo "########## $name passed in $((SECONDS - t0)) s"; times+=("$name $((SECONDS - t0)) passed")
    else echo "########## $name FAILED after $((SECONDS - t0)) s"; failed+=("$name"); times+=("$name $((SECONDS - t0)) FAILED"); fi
}

phase "background installs: matrix venvs -> $LOGS/setup-matrix.log, NeMo venv -> $LOGS/setup-nemo.log"
( t0=$SECONDS; MATRIX_SETUP_ONLY=1 "$MAKE" --no-print-directory matrix > "$LOGS/setup-matrix.log" 2>&1; rc=$?
  echo "matrix install finished rc=$rc in $((SECONDS - t0)) s" >> "$LOGS/setup-matrix.log"; exit $rc ) &
matrix_setup=$!
( t0=$SECONDS; NEMO_SETUP_ONLY=1 "$MAKE" --no-print-directory nemo > "$LOGS/setup-nemo.log" 2>&1; rc=$?
  echo "nemo install finished rc=$rc in $((SECONDS - t0)) s" >> "$LOGS/setup-nemo.log"; exit $rc ) &
nemo_setup=$!

# The fast tier first (tests/unit, about a minute, one process): a broken engine or rule shows before the long tiers.
tier test-fast "$MAKE" --no-print-directory test-fast
tier lint "$MAKE" --no-print-directory lint
# The main suite without tests/unit, which the fast tier has just run (CI time).
tier test-main "$MAKE" --no-print-directory test-main MAIN_TIERS="tests/ranks tests/bridge_real"

phase "waiting for the background installs"
for job in "matrix:$matrix_setup" "nemo:$nemo_setup"; do
    name=${job%%:*}
    if wait "${job#*:}"; then tail -n 3 "$LOGS/setup-$name.log"
    else echo "$name install failed; its log:"; cat "$LOGS/setup-$name.log"; fi
done
# Both scripts reuse what was installed and retry what was not (their stamps say which).
tier matrix "$MAKE" --no-print-directory matrix
tier nemo "$MAKE" --no-print-directory nemo

phase "done"
echo "per-tier time (the background installs ran beside test-fast, lint and test-main):"
printf '  %-10s %6s  %s\n' tier seconds result
for row in "${times[@]}"; do
    read -r name secs status <<< "$row"
    printf '  %-10s %6d  %s\n' "$name" "$secs" "$status"
done
printf '  %-10s %6d\n' total "$SECONDS"
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED tiers: ${failed[*]}"; exit 1; fi
echo "all tiers passed"
