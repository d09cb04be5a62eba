"""Two hosts on one machine: two network namespaces joined by a veth pair, each end with its own address.

Used by the multi-host tests of the main suite (``test_multihost.py``) and of the vLLM tier
(``vllm_tier/test_vllm_multinode.py``). Needs root and iproute2's ``ip``; :func:`two_hosts` raises
:class:`NetnsUnavailable` saying which is missing, so a test can skip with the reason. Everything it creates
(namespaces, the veth pair, every process still running inside) is removed when the context ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AFD", "Hosts", "NetnsUnavailable", "namespace_pids", "process_name", "two_hosts"]

#: this interpreter's ``afd`` command
AFD = [sys.executable, "-m", "afd_sdk.cli"]


class NetnsUnavailable(Exception):
    """Network namespaces cannot be made here (the message says why)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Hosts:
    """Two namespaces: ``ffn_ip`` lives in ``ffn_ns`` on ``ffn_dev``, ``attn_ip`` in ``attn_ns`` on ``attn_dev``."""

    ffn_ns: str
    attn_ns: str
    ffn_dev: str
    attn_dev: str
    ffn_ip: str
    attn_ip: str

    def argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``ns``: ``ip netns exec`` execs it, so the child's pid is the command's own."""
        return ["ip", "netns", "exec", ns, *argv]

    def run(self, ns: str, *args: str) -> subprocess.Popen[str]:
        """``afd <args>`` in ``ns``, its output piped."""
        return subprocess.Popen(self.argv(ns, [*AFD, *args]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def link(self, up: bool) -> None:
        _ip("-n", self.ffn_ns, "link", "set", self.ffn_dev, "up" if up else "down")


def namespace_pids(ns: str) -> set[int]:
    """Every process in network namespace ``ns`` now."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
    return {int(pid) for pid in out.split()}


def process_name(pid: int) -> str:
    """``/proc/<pid>/comm`` (``""`` when the process is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@contextlib.contextmanager
def two_hosts(prefix: str) -> Iterator[Hosts]:
    """Two namespaces ``<prefix>f<tag>`` and ``<prefix>a<tag>`` on a private /24, removed on exit."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("network namespaces need iproute2's `ip`")
    tag = f"{os.getpid() % 100000}"
    ffn_ns, attn_ns, ffn_dev, attn_dev = f"{prefix}f{tag}", f"{prefix}a{tag}", f"{prefix}vf{tag}", f"{prefix}va{tag}"
    subnet = f"10.{213 + sum(map(ord, prefix)) % 40}.{os.getpid() % 250}"
    made: list[str] = []
    veth = False
    try:
        try:
            for ns in (ffn_ns, attn_ns):
                _ip("netns", "add", ns)
                made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", ffn_dev, "type", "veth", "peer", "name", attn_dev)
            veth = True
            for dev, ns, ip in ((ffn_dev, ffn_ns, f"{subnet}.1"), (attn_dev, attn_ns, f"{subnet}.2")):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
        except subprocess.CalledProcessError as exc:
            raise NetnsUnavailable(f"cannot build two network namespaces here: {exc.stderr.strip() or exc}") from None
        yield Hosts(ffn_ns, attn_ns, ffn_dev, attn_dev, f"{subnet}.1", f"{subnet}.2")
    finally:
        for ns in made:  # kill what still runs inside, then the namespace (its veth end goes with it)
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                for pid in namespace_pids(ns):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.SubprocessError):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        if veth:  # still in the root namespace when moving it failed (gone with its namespace otherwise)
            with contextlib.suppress(subprocess.SubprocessError):
                subprocess.run(["ip", "link", "del", ffn_dev], capture_output=True, timeout=30)
