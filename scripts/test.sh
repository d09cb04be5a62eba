#!/usr/bin/env bash
# Install everything and run the whole test suite: lint, the main suite (.venv, no vLLM),
# then the real-vLLM tier (.venv-vllm). Any failure, or a run with no tests, fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
./scripts/bootstrap-vllm.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q --durations=10
# the tier must not pass by skipping: vLLM has to import there
.venv-vllm/bin/python -c "import vllm" 2>/dev/null || { echo "error: vLLM does not import in .venv-vllm" >&2; exit 1; }
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider --durations=10 tests/vllm_tier
