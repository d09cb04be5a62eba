"""The transformers binding: proxies refuse to run without metadata; role loads are strict."""

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers binding needs the [hf] extra")

from afd_sdk.errors import ConnectorError
from afd_sdk.metadata import ContextVarMetadataProvider
from afd_sdk.proxy import RemoteFFN


def test_proxy_without_metadata_raises():
    proxy = RemoteFFN(3, ContextVarMetadataProvider())
    with pytest.raises(ConnectorError, match="layer 3 was called with no forward metadata installed"):
        proxy(torch.zeros(1, 2, 8))
    assert list(proxy.parameters()) == []
