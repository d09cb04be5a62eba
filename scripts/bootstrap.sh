#!/usr/bin/env bash
# Create .venv with afd-sdk (editable), the bundled model adapters, the NIXL connector distribution
# (connectors/nixl, with nixl-cu12) and the dev tools, on the CPU build of torch. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
# afd_connectors.p2p._p2pwire (P2pNcclAFDConnector's native wire) is a torch extension and must compile against
# this torch: install torch and the build backend first, then build without isolation so the build sees them
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints/cpu.txt torch 'setuptools>=77'
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation -c constraints/cpu.txt \
    -e '.[hf,dev]' $(for d in models/*/; do [ -f "$d/pyproject.toml" ] && printf -- '-e %s ' "$d"; done) \
    -e connectors/nixl
