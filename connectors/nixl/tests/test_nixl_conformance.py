"""The shipped conformance suite, in full, for ``nixl``: what an outside author would run for their connector."""

from __future__ import annotations

import pytest

from afd_sdk.testing import ConnectorConformance

pytestmark = pytest.mark.multiprocess


class TestNixlConformance(ConnectorConformance):
    connector = "nixl"
