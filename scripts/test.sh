#!/usr/bin/env bash
# Install everything and run the whole test suite: lint, the main suite (.venv, no vLLM),
# then the real-vLLM tier (.venv-vllm). Any failure, or a run with no tests, fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
# the three environments install side by side (downloads, unpacking, builds; no test runs beside them, as
# timing-sensitive tests would feel them): .venv, the vLLM tier's, and the wheel tier's (every distribution built
# as users get it, installed non-editable; its build frontend has an environment of its own)
./scripts/bootstrap-vllm.sh &
VLLM_BOOTSTRAP=$!
WHEELS_LOG="$(mktemp)"
./scripts/bootstrap-wheels.sh >"$WHEELS_LOG" 2>&1 &
WHEELS_BOOTSTRAP=$!
# a failed step leaves no installer behind
trap 'kill $VLLM_BOOTSTRAP $WHEELS_BOOTSTRAP 2>/dev/null || true; rm -f "$WHEELS_LOG"' EXIT
./scripts/bootstrap.sh
wait "$VLLM_BOOTSTRAP" || { echo "error: scripts/bootstrap-vllm.sh failed" >&2; exit 1; }
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the NIXL distribution's tests must not pass by skipping either: NIXL has to import in .venv
.venv/bin/python -c "from afd_connector_nixl.agent import nixl_api; nixl_api()" \
    || { echo "error: NIXL (nixl-cu12) does not import in .venv" >&2; exit 1; }
# nor P2pNcclAFDConnector's native wire: bootstrap.sh builds afd_connectors.p2p._p2pwire against .venv's torch
.venv/bin/python -c "from afd_connectors.p2p.wire import native_wire_problem as p; import sys; sys.exit(p())" \
    || { echo "error: afd_connectors.p2p._p2pwire is not built in .venv" >&2; exit 1; }
# nor ZmqAFDConnector's C++ steady state (afd_connectors.zmq._zmqsteady, built the same way)
.venv/bin/python -c "from afd_connectors.zmq.wire import steady_problem as p; import sys; sys.exit(p())" \
    || { echo "error: afd_connectors.zmq._zmqsteady is not built in .venv" >&2; exit 1; }
# nor ShmAFDConnector's (afd_connectors.shm._shmsteady, likewise)
.venv/bin/python -c "import torch; from afd_connectors.shm import _shmsteady" \
    || { echo "error: afd_connectors.shm._shmsteady is not built in .venv" >&2; exit 1; }
wait "$WHEELS_BOOTSTRAP" || { cat "$WHEELS_LOG" >&2; echo "error: scripts/bootstrap-wheels.sh failed" >&2; exit 1; }
# the main suite, with the wheel tier (tests/wheel_tier, from .venv-wheels) and the public-API check
# (tests/test_api_snapshot.py against api/public-api.json)
.venv/bin/python -m pytest -q --durations=25
# the tier must not pass by skipping: vLLM has to import there
.venv-vllm/bin/python -c "import vllm" 2>/dev/null || { echo "error: vLLM does not import in .venv-vllm" >&2; exit 1; }
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider --durations=25 tests/vllm_tier
