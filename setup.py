"""The one native module: ShmAFDConnector's doorbell and copies (atomics, futex, memcpy).

Everything else is declared in pyproject.toml; pip builds this with the system C compiler.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "afd_connectors._shmring",
            sources=["connectors/afd_connectors/_shmring.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Werror"],
        )
    ]
)
