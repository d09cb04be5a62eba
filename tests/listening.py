"""The listening TCP sockets of a process tree, read from ``/proc`` (Linux): who listens where, during a run.

Used by the runtime E2E to prove that every socket the SDK listens on (control planes, data planes,
``TCPStore``, Gloo devices) is bound to the configured address, never to every interface.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["ListenerWatch", "descendants", "is_wildcard", "listening"]

_LISTEN = "0A"


def descendants(root: int) -> set[int]:
    """``root`` and every process below it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid and p not in out]
        out.update(kids)
        frontier += kids
    return out


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ".".join(str(b) for b in reversed(raw))
    return ":".join(raw[i : i + 4][::-1].hex() for i in range(0, 16, 4))


def listening(pids: set[int]) -> set[tuple[str, int]]:
    """``(address, port)`` of every listening TCP socket the processes ``pids`` hold."""
    out: set[tuple[str, int]] = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            tables = [Path(f"/proc/{pid}/net/{t}").read_text().splitlines()[1:] for t in ("tcp", "tcp6")]
        except OSError:  # the process ended while it was read
            continue
        inodes = {link[8:-1] for link in links if link.startswith("socket:[")}
        for fields in (row.split() for table in tables for row in table):
            if fields[3] == _LISTEN and fields[9] in inodes:
                addr, port = fields[1].rsplit(":", 1)
                out.add((_address(addr), int(port, 16)))
    return out


def is_wildcard(address: str) -> bool:
    """``0.0.0.0`` or ``::`` (IPv6 all zeros, as :func:`listening` writes it)."""
    return set(address) <= {"0", ".", ":"}


class ListenerWatch:
    """Samples the listening sockets of this process's descendants every ``interval_s`` until stopped."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.seen: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._me = os.getpid()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="listener-watch", daemon=True)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.seen |= listening(descendants(self._me) - {self._me})

    def __enter__(self) -> ListenerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
