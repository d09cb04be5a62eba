"""The native modules; everything else is declared in pyproject.toml.

- ``_shmring``: ShmAFDConnector's doorbell and copies (atomics, futex, memcpy).
- ``_zmqwire``: ZmqAFDConnector's per-message send and receive, on the libzmq pyzmq loaded.
- ``_p2pwire``: P2pNcclAFDConnector's process-group calls and attention steady state, C++ against c10d.
- ``_zmqsteady``: ZmqAFDConnector's steady state in C++, on ``_zmqwire``'s C API.
- ``_shmsteady``: ShmAFDConnector's steady state in C++, on ``_shmring``'s ring primitives (``_shmring_core.h``).

pip builds the two C modules with the system C compiler on Linux (futex, dlopen). Elsewhere, or when a build
fails, afd-sdk installs without it: ShmAFDConnector reports the missing module at config validation, and
ZmqAFDConnector moves messages through pyzmq instead (its ``wire_name`` says which;
connector_extra_config.wire="native" makes a missing module a config error).

``_p2pwire``, ``_zmqsteady`` and ``_shmsteady`` are torch extensions: each must be compiled against the very torch
it runs with, so they are built only when torch is importable here, i.e. when pip builds without isolation (``pip
install --no-build-isolation``, as scripts/bootstrap.sh does). Without them P2pNcclAFDConnector makes the same calls
from Python (connector_extra_config.wire, ``wire_name``) and ZmqAFDConnector and ShmAFDConnector run their steady
states in Python.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
cmdclass = {}
if sys.platform.startswith("linux"):
    ext_modules += [
        Extension(
            "afd_connectors._shmring",
            sources=["connectors/afd_connectors/_shmring.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Werror"],
            optional=True,
        ),
        Extension(
            "afd_connectors._zmqwire",
            sources=["connectors/afd_connectors/_zmqwire.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Werror"],
            libraries=["dl"],
            optional=True,
        ),
    ]
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # an isolated build: no torch to compile against
        pass
    else:
        for name in ("_p2pwire", "_zmqsteady", "_shmsteady"):
            ext = CppExtension(
                f"afd_connectors.{name}",
                sources=[f"connectors/afd_connectors/{name}.cpp"],
                extra_compile_args=["-O2", "-Wall", "-g0"],  # no debug info: 0.4 MB instead of 6.9 MB (_p2pwire)
            )
            ext.optional = True
            ext_modules.append(ext)
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=False)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
