"""The version of afd-sdk (one place; ``afd_sdk.__version__`` re-exports it)."""

__version__ = "0.2.0"
