#!/usr/bin/env bash
# Create .venv, install pinned dependencies (torch first, CPU wheel), generate protobuf code.
# Idempotent: re-runs pip only when a requirements file changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
want=$(cat requirements.txt requirements-test.txt pyproject.toml | sha256sum | cut -d' ' -f1)
have=$(cat .venv/.setup-stamp 2>/dev/null || true)
if [ "$want" != "$have" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  # torch alone and first: the pinned CPU wheel, so no other package can pull a CUDA build.
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-test.txt
  # The `nixl` import name, without its dependencies (they would pull CUDA 12 packages).
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps nixl==1.5.1
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
  echo "$want" > .venv/.setup-stamp
fi
.venv/bin/python scripts/gen_protos.py >/dev/null
