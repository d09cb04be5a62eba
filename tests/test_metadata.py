import threading

import pytest

from afd_sdk.errors import AFDConfigError
from afd_sdk.metadata import ContextVarMetadataProvider, ForwardMetadata


def md(stage=0, stages=1, conn=None):
    return ForwardMetadata(stage, stages, (0,) * stages, (1,) * stages, (1,) * stages, (0,) * stages, conn)


def test_install_nests_and_restores_on_exception():
    p = ContextVarMetadataProvider()
    a, b = md(), md()
    assert p.current() is None
    with p.install(a):
        assert p.current() is a
        with pytest.raises(RuntimeError), p.install(b):
            assert p.current() is b
            raise RuntimeError("boom")
        assert p.current() is a
    assert p.current() is None


def test_threads_see_their_own_stage():
    p = ContextVarMetadataProvider()
    seen = {}
    barrier = threading.Barrier(2, timeout=10)

    def worker(stage):
        with p.install(md(stage, 2)):
            barrier.wait()
            seen[stage] = p.current().stage_idx
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {0: 0, 1: 1}


def test_validation():
    with pytest.raises(AFDConfigError, match="stage_idx=2 with num_stages=2"):
        md(2, 2)
    with pytest.raises(AFDConfigError, match="stage_token_len_padded"):
        ForwardMetadata(0, 1, (0,), (4,), (3,), (0,), None)
