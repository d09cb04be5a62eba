"""afd-sdk model adapter for gpt-oss, the worked example of ``docs/writing-a-model-adapter.md``."""

__version__ = "0.1.0"
