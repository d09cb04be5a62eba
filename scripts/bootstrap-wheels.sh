#!/usr/bin/env bash
# The wheel tier's environment: build every distribution (scripts/build-wheels.sh), then install only those
# wheels, non-editable, into a new .venv-wheels beside the CPU torch (constraints/cpu.txt) and their declared
# dependencies. tests/wheel_tier runs afd-sdk from there, never from this source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# the build frontend runs from a throwaway environment of its own, not .venv: scripts/test.sh builds the wheels
# while scripts/bootstrap.sh is still creating .venv
BUILDENV="$(mktemp -d)"
trap 'rm -rf "$BUILDENV"' EXIT
"$PY" -m venv "$BUILDENV"
"$BUILDENV/bin/python" -m pip install --quiet --disable-pip-version-check 'build>=1.2'
PYTHON="$BUILDENV/bin/python" ./scripts/build-wheels.sh
rm -rf .venv-wheels
"$PY" -m venv .venv-wheels
PIP=(.venv-wheels/bin/python -m pip install --quiet --disable-pip-version-check -c constraints/cpu.txt)
"${PIP[@]}" torch
SDK=(dist/afd_sdk-*.whl)
"${PIP[@]}" "${SDK[0]}[hf]" dist/afd_models_qwen-*.whl dist/afd_models_deepseek-*.whl dist/afd_connector_nixl-*.whl
