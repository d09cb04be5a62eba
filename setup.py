"""The one native module: ShmAFDConnector's doorbell and copies (atomics, futex, memcpy).

Everything else is declared in pyproject.toml. pip builds the module with the system C compiler on
Linux (it uses futex). Elsewhere, or when the build fails, afd-sdk installs without it and
ShmAFDConnector reports the missing module at config validation; the other connectors are unaffected.
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
        )
    ]
    if sys.platform.startswith("linux")
    else []
)
