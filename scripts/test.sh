#!/usr/bin/env bash
# Set up (or reuse) the venv, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${SWIFTLITE_VENV:-.venv}/bin/activate"
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export TOKENIZERS_PARALLELISM=false
export SWIFTLITE_CACHE=${SWIFTLITE_CACHE:-$PWD/.cache/swiftlite}
exec python -m pytest -q --durations=20 "$@"
