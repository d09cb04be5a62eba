"""Warm worker starts: a fork server that has already imported torch and afd-sdk.

Every rank :func:`afd_sdk.runtime.world.run_world` starts is a fresh
interpreter, and a fresh interpreter spends seconds importing torch,
transformers and the SDK before it does anything. A test suite that starts
hundreds of ranks pays that hundreds of times. The zygote pays it once: it
imports those modules (no torch op, no thread pool, no plugin discovery),
then, per request, ``fork()``\\ s a child that runs ``python -m <module>
<args>`` in place (``runpy``) with the requester's environment, working
directory and standard streams (passed over the Unix socket as descriptors,
never pickled). The child starts a session of its own, as
``Popen(start_new_session=True)`` does, so the launcher's ``killpg`` works
unchanged.

Only requests that a fork can serve faithfully are taken (see
:meth:`Zygote.eligible`): the same interpreter-level environment
(``PYTHON*``, ``LD_*``, thread counts, ``CUDA_VISIBLE_DEVICES``, ``TORCH_*``, ``HF_*``) the zygote started with, and a
module outside vLLM (vLLM's engine starts processes of its own and must not
inherit a forked interpreter). Everything else starts cold, as before.

This is a test-suite accelerator, switched on by
:func:`afd_sdk.testing.enable_warm_workers`; ``afd demo`` and the CLI always
start cold interpreters.

Protocol (one connection per child): the client sends an 8-byte length, then
a JSON header ``{"module", "args", "env", "cwd"}``, with three descriptors
(stdin, stdout, stderr) as ``SCM_RIGHTS``; the server answers ``pid N\\n``
once forked and ``rc N\\n`` when the child has exited (``N`` as
:attr:`subprocess.Popen.returncode`: negative for a signal).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["WarmProcess", "Zygote", "active_zygote", "disable", "enable"]

logger = logging.getLogger(__name__)

#: modules the zygote imports before it forks: what a world rank imports first anyway. Never a module a rank
#: runs as ``__main__`` (runpy would warn and the rank would hold two copies of it): their imports instead
PRELOAD = (
    "torch",
    "numpy",
    "zmq",
    "transformers",
    "afd_sdk.runtime.attention_runner",
    "afd_sdk.runtime.session",
    "afd_sdk.runtime.serve",
    "afd_sdk.runtime.reference",
    "afd_connectors",
)
#: environment variables the interpreter, the loader, the math libraries, torch or transformers read at start-up or
#: import: a request must match the zygote's (variables read later, ``AFD_*`` among them, come from the request)
_IMPORT_TIME_ENV = (
    "PYTHON",
    "LD_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "CUDA_VISIBLE_DEVICES",
    "TORCH_",  # TORCH_LOGS and others are read by ``import torch`` (not TORCHINDUCTOR_*, set later by torch itself)
    "HF_",  # read by ``import transformers`` / huggingface_hub
    "TRANSFORMERS_",
)
#: module prefixes never forked (vLLM starts its own engine processes and CUDA/fork state of its own)
_COLD_MODULES = ("vllm", "afd_sdk.integrations.vllm")
#: how long a client waits for a new zygote to finish importing and listen
READY_TIMEOUT_S = 120.0


def _import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_ENV)}


class WarmProcess:
    """A child of the zygote, with the part of :class:`subprocess.Popen` the launcher uses.

    The zygote, not this process, is the child's parent; its exit status
    arrives over ``sock`` as ``rc N``.
    """

    def __init__(self, sock: socket.socket, pid: int, pending: bytes = b"") -> None:
        self._sock = sock
        self._buf = pending
        self.pid = pid
        self.returncode: int | None = None
        self.args = ["<zygote>", str(pid)]
        self._parse()  # the exit status may have come with the pid (a rank that ended at once)

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        if self._sock.fileno() < 0:
            return
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return
        chunk = self._sock.recv(64)
        if not chunk:
            self._orphaned()
            return
        self._buf += chunk
        self._parse()

    def _parse(self) -> None:
        if self._buf.endswith(b"\n"):
            kind, value = self._buf.split()
            if kind == b"rc":
                self.returncode = int(value)
                self._sock.close()

    def _orphaned(self) -> None:
        """The zygote died before reporting: the exit status is lost with it; only whether the child runs is known."""
        try:
            os.kill(self.pid, 0)
            time.sleep(0.05)
        except ProcessLookupError:
            self.returncode = 1
            self._sock.close()
            logger.warning("warm worker %d: the zygote died first; exit status unknown (reported as 1)", self.pid)

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(None if left is None else min(left, 1.0))
        return self.returncode

    def kill(self) -> None:
        if self.poll() is not None:
            return  # reaped by the zygote: the pid may belong to another process by now
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Zygote:
    """The client side: starts the server process and asks it for children."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="afd-zygote-")
        self.path = os.path.join(self._dir, "sock")
        self._env = _import_time_env(os.environ)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "afd_sdk.runtime.zygote", self.path],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def eligible(self, module: str, env: Mapping[str, str]) -> bool:
        """Whether a fork of this zygote runs ``module`` as a fresh interpreter with ``env`` would."""
        if module.startswith(_COLD_MODULES) or self._proc.poll() is not None:
            return False
        return _import_time_env(env) == self._env

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if self._proc.poll() is not None:
                    raise RuntimeError(f"the warm-worker zygote exited with {self._proc.returncode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the warm-worker zygote did not listen within {READY_TIMEOUT_S:g}s") from None
                time.sleep(0.05)

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        stdout: IO[Any] | int | None,
        stderr: IO[Any] | int | None,
        cwd: str | None = None,
    ) -> WarmProcess:
        """Fork ``python -m module *args``; ``stdout``/``stderr`` as Popen takes them (file, ``DEVNULL``, ``None``)."""
        sock = self._connect()
        try:
            with open(os.devnull, "r+b") as null:
                fds = [null.fileno(), _fd(stdout, null, 1), _fd(stderr, null, 2)]
                header = {"module": module, "args": list(args), "env": dict(env), "cwd": cwd or os.getcwd()}
                body = json.dumps(header).encode()
                socket.send_fds(sock, [struct.pack("!Q", len(body)) + body], fds)
            line, rest = _read_line(sock, READY_TIMEOUT_S)
            kind, _, value = line.partition(" ")
            if kind != "pid":
                raise RuntimeError(f"the warm-worker zygote refused {module}: {line}")
            return WarmProcess(sock, int(value), rest)
        except BaseException:
            sock.close()
            raise

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        Path(self.path).unlink(missing_ok=True)
        os.rmdir(self._dir)


def _fd(stream: IO[Any] | int | None, null: IO[bytes], inherited: int) -> int:
    if stream is None:
        return inherited
    if stream == subprocess.DEVNULL:
        return null.fileno()
    if isinstance(stream, int):
        return stream
    return stream.fileno()


def _read_line(sock: socket.socket, timeout: float) -> tuple[str, bytes]:
    """The first line (decoded, stripped) and whatever arrived after it."""
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise TimeoutError(f"the warm-worker zygote did not answer within {timeout:g}s")
        chunk = sock.recv(64)
        if not chunk:
            raise RuntimeError("the warm-worker zygote closed the connection without answering")
        buf += chunk
    line, _, rest = buf.partition(b"\n")
    return line.decode().strip(), rest


_active: Zygote | None = None


def enable() -> Zygote:
    """Start the process-wide zygote (idempotent); :func:`run_world` forks eligible ranks from it."""
    global _active
    if _active is None:
        _active = Zygote()
    return _active


def disable() -> None:
    """Stop the process-wide zygote; later ranks start cold."""
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def active_zygote() -> Zygote | None:
    return _active


# --------------------------------------------------------------------------------------------- server side


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(30.0)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 8:
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("request cut short")
        data += more
    (size,) = struct.unpack("!Q", data[:8])
    body = data[8:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ConnectionError("request cut short")
        body += more
    return json.loads(body), list(fds)


def _child(request: dict[str, Any], fds: list[int], keep_closed: list[int]) -> None:
    """Runs in the forked child; never returns."""
    import atexit
    import importlib
    import random
    import runpy
    import threading

    code, sig = 1, 0
    try:
        os.setsid()
        for fd in keep_closed:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        # as a fresh interpreter has them: SIGPIPE ignored (a write to a closed socket raises), SIGINT raises
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # what ``python -m`` puts first: the directory it was started in
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()
        try:
            import numpy

            numpy.random.seed()
        except ImportError:
            pass  # no numpy: nothing to reseed
        importlib.invalidate_caches()
        from afd_sdk.plugins import reset_plugin_manager

        reset_plugin_manager()  # discovery reads the child's environment and installed distributions
        sys.argv = [request["module"], *request["args"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            sig = signal.SIGINT  # a fresh interpreter re-raises SIGINT on itself: Popen reports -2
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as interpreter exit does
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if sig:
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            os._exit(code & 0xFF)


def serve(path: str) -> None:
    """The server loop: preload, listen on ``path``, fork per request, report exits; ends with its parent."""
    import importlib

    parent = os.getppid()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an optional module (transformers without [hf]): its ranks import it themselves
            print(f"afd zygote: not preloading {name}: {exc}", file=sys.stderr)
    import gc

    gc.collect()
    gc.freeze()  # the preloaded heap is shared copy-on-write, not touched by every child's collector
    stop = False

    def _on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_term)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients connect only once the preload is done
    children: dict[int, socket.socket] = {}
    while not stop and os.getppid() == parent:
        try:
            ready, _, _ = select.select([listener], [], [], 0.05)
        except InterruptedError:
            ready = []
        if ready:
            conn, _ = listener.accept()
            try:
                request, fds = _recv_request(conn)
            except (OSError, ValueError) as exc:
                print(f"afd zygote: bad request: {exc}", file=sys.stderr)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child keeps no zygote socket, its own connection included
                _child(request, fds, [listener.fileno(), conn.fileno(), *(c.fileno() for c in children.values())])
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"pid {pid}\n".encode())
            except OSError as exc:  # the client gave up; the child still runs and is reaped below
                print(f"afd zygote: could not tell the client child {pid} started: {exc}", file=sys.stderr)
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"rc {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError as exc:  # the client is gone; nobody waits for this status
                    print(f"afd zygote: child {pid}'s exit status had no reader: {exc}", file=sys.stderr)
                conn.close()
    listener.close()


if __name__ == "__main__":
    serve(sys.argv[1])
