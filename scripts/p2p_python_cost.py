"""The Python that ``P2pNcclAFDConnector`` runs per call, without Gloo: ``python scripts/p2p_python_cost.py``.

One attention and one FFN connector in this process (the Python wire),
initialised for real, then their wires' process groups replaced by stubs
whose works complete at once, so what is timed is the connector's own code:
checks, plans, bookkeeping. (The native wire needs real groups.) Real
Gloo calls vary from run to run more than this whole cost (docs/connectors.md,
"p2p's memoised checks, measured without Gloo"). Prints the median per call of
8 layers x ``--steps`` steps of 2 tokens x 1024 fp32 (8 KiB).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from afd_connectors.p2p.wire import PythonWire
from afd_sdk.runtime.attention_runner import announce_step
from afd_sdk.runtime.session import connector_from_spec
from afd_sdk.runtime.world import free_port_block
from afd_sdk.testing import init_in_threads
from afd_sdk.wire import ControlPayload, TransferMetadata

LAYERS = 8


class _Done:
    def wait(self, *_args: Any) -> bool:
        return True


class _Group:
    """Stands in for a stage's process group: every send and receive is complete at once."""

    def send(self, *_args: Any) -> _Done:
        return _Done()

    def recv(self, *_args: Any) -> _Done:
        return _Done()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    spec = {
        "afd": {
            "connector": "p2p",
            "port": free_port_block(16),
            "timeout_s": 5,
            "connector_extra_config": {"wire": "python"},
        },
        "model": {"architecture": "T", "hidden_size": 1024, "dtype": "float32", "num_layers": LAYERS},
        "max_num_tokens": 8,
    }
    ffn = connector_from_spec({**spec, "role": "ffn", "rank": 0})
    attn = connector_from_spec({**spec, "role": "attention", "rank": 0})
    init_in_threads(ffn, [attn], timeout_s=10)
    real = attn._wire, ffn._wire
    attn._wire, ffn._wire = PythonWire([_Group()], attn._peers, 5), PythonWire([_Group()], ffn._peers, 5)
    x = torch.randn(2, 1024)
    metadata = [TransferMetadata(layer, 0, (2,)) for layer in range(LAYERS)]
    times: dict[str, list[int]] = {"attention send": [], "attention receive": [], "ffn receive": [], "ffn send": []}
    clock = time.perf_counter_ns
    try:
        for step in range(args.steps):
            announce_step(attn, ControlPayload(step, ((2,),), 2, LAYERS))
            plane = ffn.require_control_plane()
            plane.apply(plane.recv(timeout_s=5))
            for md in metadata:
                t0 = clock()
                attn.send_attn_output(x, md)
                t1 = clock()
                payload = ffn.recv_attn_output(0)
                t2 = clock()
                ffn.send_ffn_output(payload.hidden_states, payload.metadata)
                t3 = clock()
                attn.recv_ffn_output(x, 0)
                t4 = clock()
                for name, dt in zip(times, (t1 - t0, t4 - t3, t2 - t1, t3 - t2), strict=True):
                    times[name].append(dt)
    finally:
        attn._wire, ffn._wire = real
        attn.close()
        ffn.close()
    skip = len(times["ffn send"]) // 4  # warm-up
    medians = {name: statistics.median(v[skip:]) / 1e3 for name, v in times.items()}
    for name, us in medians.items():
        print(f"{name:18s} {us:6.2f} µs")
    print(f"{'round trip':18s} {sum(medians.values()):6.2f} µs")


if __name__ == "__main__":
    main()
