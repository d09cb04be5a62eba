"""CAMAsyncAFDConnector's portable backend through the shipped async-dispatch suite (real processes)."""

import pytest

from afd_sdk.testing import AsyncDispatchConformance

pytestmark = pytest.mark.multiprocess


class TestCamPortable(AsyncDispatchConformance):
    connector = "CAMAsyncAFDConnector"
    extra_config = {"backend": "portable"}
