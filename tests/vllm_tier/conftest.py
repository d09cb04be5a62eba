"""The tier's vLLM processes keep their ZMQ ipc socket files under pytest's own temporary directory.

vLLM names them ``<VLLM_RPC_BASE_PATH>/<uuid>`` (default: the system temp directory) and a process that is
killed (the tier kills FFN servers and engines on purpose) cannot remove its own; pytest prunes its
directories, the system temp directory nobody does.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def vllm_ipc_sockets_in_tmp(tmp_path_factory):
    old = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = str(tmp_path_factory.mktemp("vllm-rpc"))
    yield
    if old is None:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = old
