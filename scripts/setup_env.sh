#!/usr/bin/env bash
# Create or reuse the project venv (.venv) and install swiftlite with its dev extras.
# On a machine without a CUDA GPU, the CPU build of torch (torch==2.13.0) is installed first so that
# pip never pulls a multi-GB CUDA build; with a GPU, pip's normal torch is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SWIFTLITE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.swiftlite-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    python -m pip install -q "torch==${SWIFTLITE_CPU_TORCH:-2.13.0}"
  fi
fi
python -m pip install -q -e ".[dev]"
touch "$stamp"
