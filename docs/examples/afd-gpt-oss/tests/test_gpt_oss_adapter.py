"""The author's own test: the shipped adapter kit, run on the installed adapter."""

from afd_sdk.testing.adapters import AdapterConformance


class TestGptOssAdapter(AdapterConformance):
    architectures = ("GptOssForCausalLM",)
