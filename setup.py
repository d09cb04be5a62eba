"""The two native modules; everything else is declared in pyproject.toml.

- ``_shmring``: ShmAFDConnector's doorbell and copies (atomics, futex, memcpy).
- ``_zmqwire``: ZmqAFDConnector's per-message send and receive, on the libzmq pyzmq loaded.

pip builds them with the system C compiler on Linux (futex, dlopen). Elsewhere, or when a build fails,
afd-sdk installs without it: ShmAFDConnector reports the missing module at config validation, and
ZmqAFDConnector moves messages through pyzmq instead (its ``wire_name`` says which;
connector_extra_config.wire="native" makes a missing module a config error).
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
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
    if sys.platform.startswith("linux")
    else []
)
