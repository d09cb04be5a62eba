"""The public transport kit: what every new point-to-point transport reuses.

An RDMA, UCX or plain-socket connector author writes only the data path; the
rest is here, and the built-in ZMQ, P2P and shared-memory connectors use the
same pieces:

* :class:`ZmqControlPlane` — rendezvous, handshake (model fingerprint, dtype,
  hidden size, layer count, protocol version; a mismatch is
  :class:`~afd_sdk.wire.HandshakeReject` → ``HandshakeError`` on both roles),
  per-step control payloads, heartbeats, goodbye and liveness.
* :class:`ZmqEndpoint` — one ZMQ socket with ZMTP heartbeats and a disconnect
  monitor; every wait has a deadline. :func:`terminate_context` — a context's
  ``term()`` with one too.
* :class:`BufferPool` / :class:`DeviceBuffers` — grow-only receive buffers.
* :func:`tensor_header`, :func:`send_frames`, :func:`recv_tensor`,
  :func:`frame_tensor`, :func:`frame_size_error`, :func:`tensor_bytes` —
  tensor framing: a msgpack header, then raw buffers;
  :class:`HeaderCache` keeps the steady state free of msgpack work.
* :class:`SendRecord` — the attention side's sends awaiting their FFN output, shared by a connector's Python
  and native steady states; :class:`PlanCache` — the one bounded memo of a steady state's checked plans;
  :class:`SteadyState` — the protocol of a native steady state that declines to the checked path.
* :func:`stage_groups`, :func:`wait_works` (:func:`work_failed` for one
  handle waited by hand), :func:`shutdown_groups` —
  torch.distributed process groups per micro-batch stage, built on a store;
  :func:`open_tcp_store` (bound to ``afd.host`` only) and
  :func:`check_store_port` for connectors that exchange set-up data through one.

This package imports pyzmq (a dependency of afd-sdk) but no device library;
``import afd_sdk`` does not import it.
"""

from afd_sdk.connector import SendRecord
from afd_sdk.control.buffers import BufferPool, DeviceBuffers, nbytes_of
from afd_sdk.control.endpoint import ZmqEndpoint, endpoint_address, terminate_context
from afd_sdk.control.framing import (
    ZERO_COPY_MIN,
    HeaderCache,
    frame_size_error,
    frame_tensor,
    recv_tensor,
    send_frames,
    spec_of,
    tensor_bytes,
    tensor_header,
    writable_bytes,
)
from afd_sdk.control.plane import ZmqControlPlane, compare_hellos, merge_payloads
from afd_sdk.control.process_groups import (
    check_store_port,
    open_tcp_store,
    route_source,
    shutdown_groups,
    stage_groups,
    wait_works,
    work_failed,
)
from afd_sdk.control.steady import PLAN_CACHE_LIMIT, AttentionSteadyState, FFNSteadyState, PlanCache, SteadyState

__all__ = [
    "PLAN_CACHE_LIMIT",
    "ZERO_COPY_MIN",
    "AttentionSteadyState",
    "BufferPool",
    "DeviceBuffers",
    "FFNSteadyState",
    "HeaderCache",
    "PlanCache",
    "SendRecord",
    "SteadyState",
    "ZmqControlPlane",
    "ZmqEndpoint",
    "check_store_port",
    "compare_hellos",
    "endpoint_address",
    "frame_size_error",
    "frame_tensor",
    "merge_payloads",
    "nbytes_of",
    "open_tcp_store",
    "recv_tensor",
    "route_source",
    "send_frames",
    "shutdown_groups",
    "spec_of",
    "stage_groups",
    "tensor_bytes",
    "tensor_header",
    "terminate_context",
    "wait_works",
    "work_failed",
    "writable_bytes",
]
