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


#: the serving tests' model: a seeded tiny Qwen3-MoE with a word-level tokenizer (same bytes for every module)
SERVING_ARCH = "Qwen3MoeForCausalLM"


@pytest.fixture(scope="session")
def serving_model(tmp_path_factory) -> str:
    pytest.importorskip("vllm", reason="vLLM is not installed here; run the tier with scripts/bootstrap-vllm.sh")
    from afd_sdk.integrations.vllm.serve import save_serving_checkpoint

    return str(save_serving_checkpoint(SERVING_ARCH, tmp_path_factory.mktemp("serving") / "model"))


@pytest.fixture(scope="session")
def native_server(tmp_path_factory, serving_model):
    """Plain ``vllm serve`` of :func:`serving_model`: the reference of every serving module, started once.

    Returned started, not yet healthy (``wait_healthy``), so a module's own servers start beside it.
    """
    from serve_processes import BIN, ENGINE, Server, multiprocessing_segments, remove_segments

    from afd_sdk.integrations.vllm.serve import serve_argv
    from afd_sdk.runtime.world import free_port_block

    before = multiprocessing_segments()
    http = free_port_block(1)
    argv = serve_argv(serving_model, None, port=http, executable=str(BIN / "vllm"), **ENGINE)
    server = Server("native", argv, tmp_path_factory.mktemp("native"), http_port=http)
    try:
        yield server
    finally:
        server.stop()
        # vLLM processes killed on purpose (an FFN's SIGKILL) or by vLLM's own force-kill at shutdown leave their
        # multiprocessing segments behind; every serving process is gone by now (module deployments stop
        # before the session ends), so the segments that appeared meanwhile are ours to remove
        remove_segments(multiprocessing_segments() - before)
