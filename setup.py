"""The native modules; everything else is declared in pyproject.toml.

Each lives beside the connector that uses it (``connectors/afd_connectors/<transport>/``):

- ``shm._shmring``: ShmAFDConnector's doorbell and copies (atomics, futex, memcpy).
- ``zmq._zmqwire``: ZmqAFDConnector's per-message send and receive, on the libzmq pyzmq loaded.
- ``p2p._p2pwire``: P2pNcclAFDConnector's process-group calls and attention steady state, C++ against c10d.
- ``zmq._zmqsteady``: ZmqAFDConnector's steady state in C++, on ``_zmqwire``'s C API.
- ``shm._shmsteady``: ShmAFDConnector's steady state in C++, on ``_shmring``'s ring primitives
  (``_shmring_core.h``).

pip builds the two C modules with the system C compiler on Linux (futex, dlopen). Elsewhere, or when a build
fails, afd-sdk installs without it: ShmAFDConnector reports the missing module at config validation, and
ZmqAFDConnector moves messages through pyzmq instead (its ``wire_name`` says which;
connector_extra_config.wire="native" makes a missing module a config error).

``_p2pwire``, ``_zmqsteady`` and ``_shmsteady`` are torch extensions: each must be compiled against the very torch
it runs with, so they are built only when torch is importable here, i.e. when pip builds without isolation (``pip
install --no-build-isolation``, as scripts/bootstrap.sh does). Without them P2pNcclAFDConnector makes the same calls
from Python (connector_extra_config.wire, ``wire_name``) and ZmqAFDConnector and ShmAFDConnector run their steady
states in Python. ``AFD_NO_TORCH_EXTENSIONS=1`` skips them in any build. Beside them the build writes
``afd_connectors/_torch_build.json`` (the torch version and C++ ABI they were compiled against);
``afd_connectors.native`` refuses to load them against any other torch.
"""

import json
import os
import sys
from pathlib import Path

from setuptools import Extension, setup

ext_modules = []
cmdclass = {}
if sys.platform.startswith("linux"):
    ext_modules += [
        Extension(
            "afd_connectors.shm._shmring",
            sources=["connectors/afd_connectors/shm/_shmring.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Werror"],
            optional=True,
        ),
        Extension(
            "afd_connectors.zmq._zmqwire",
            sources=["connectors/afd_connectors/zmq/_zmqwire.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Werror"],
            libraries=["dl"],
            optional=True,
        ),
    ]
    try:
        if os.environ.get("AFD_NO_TORCH_EXTENSIONS") == "1":  # a quick build (the packaging tests); same fallbacks
            raise ImportError("AFD_NO_TORCH_EXTENSIONS=1")
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # an isolated build: no torch to compile against
        pass
    else:
        torch_extensions = []
        for transport, name in (("p2p", "_p2pwire"), ("zmq", "_zmqsteady"), ("shm", "_shmsteady")):
            ext = CppExtension(
                f"afd_connectors.{transport}.{name}",
                sources=[f"connectors/afd_connectors/{transport}/{name}.cpp"],
                extra_compile_args=["-O2", "-Wall", "-g0"],  # no debug info: 0.4 MB instead of 6.9 MB (_p2pwire)
            )
            ext.optional = True
            ext_modules.append(ext)
            torch_extensions.append(ext.name)

        class BuildWithRecord(BuildExtension.with_options(use_ninja=False)):
            """Builds the extensions, then records which torch the torch extensions were compiled against."""

            def run(self) -> None:
                # an optional extension that fails to compile leaves no module behind: a stale one from an
                # earlier torch must not be recorded below as built against this torch
                for name in torch_extensions:
                    Path(self.get_ext_fullpath(name)).unlink(missing_ok=True)
                super().run()
                import torch

                built = [n for n in torch_extensions if Path(self.get_ext_fullpath(n)).exists()]
                if not built:
                    return
                record = {
                    "torch": torch.__version__,
                    "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
                    "extensions": sorted(built),
                }
                out = Path(self.get_ext_fullpath("afd_connectors._torch_build")).with_name("_torch_build.json")
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(record, indent=1) + "\n")

        cmdclass["build_ext"] = BuildWithRecord

setup(ext_modules=ext_modules, cmdclass=cmdclass)
