#!/usr/bin/env bash
# Set up (or reuse) the venv, then run the test suite. Extra arguments go to pytest.
#   scripts/test.sh            the CI suite: every test but those marked `long`
#   scripts/test.sh --all      every test, `long` ones included (memory measurements on 24M-157M-parameter
#                              models and the further cases of claims the CI suite checks once)
# A `-m EXPR` of your own replaces the default selection.
set -euo pipefail
cd "$(dirname "$0")/.."
select=(-m "not long")
args=()
for a in "$@"; do
  case "$a" in
    --all) select=() ;;
    -m|-m=*) select=(); args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${SWIFTLITE_VENV:-.venv}/bin/activate"
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export TOKENIZERS_PARALLELISM=false
export SWIFTLITE_CACHE=${SWIFTLITE_CACHE:-$PWD/.cache/swiftlite}
# Two pytest workers (pytest-xdist, a dev extra): most tests run one single-threaded process, so one worker
# leaves a core of this 2-core class of machine idle. Each file's tests run on one worker (`--dist loadfile`):
# a module's shared runs are trained once. SWIFTLITE_TEST_WORKERS=0 runs them all in this process.
workers=${SWIFTLITE_TEST_WORKERS:-2}
par=()
if [ "$workers" != 0 ]; then
  par=(-n "$workers" --dist loadfile)
fi
exec python -m pytest -q --durations=30 "${par[@]}" "${select[@]}" "${args[@]}"
