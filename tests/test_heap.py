"""freeze_startup_heap: the start-up heap leaves the garbage collector's generations, new objects do not."""

import json
import subprocess
import sys

_CHILD = """
import gc, json
import torch  # a start-up heap of the size a rank has
from afd_sdk.runtime.heap import freeze_startup_heap

before = len(gc.get_objects())
frozen = freeze_startup_heap()
after = len(gc.get_objects())
cycle = []
cycle.append(cycle)  # garbage made after the freeze is still collected
del cycle
found = gc.collect()
print(json.dumps({"before": before, "frozen": frozen, "after": after, "found": found, "enabled": gc.isenabled()}))
"""


def test_freezes_the_start_up_heap_and_still_collects_what_comes_after():
    """In a child process: a frozen heap must not leak into the test session's."""
    res = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["before"] > 10_000  # torch alone leaves tens of thousands of tracked objects
    assert got["frozen"] >= got["before"] * 0.9
    assert got["after"] < got["before"] / 20  # a full collection now scans a few hundred, not all of them
    assert got["found"] >= 1  # the cycle made after the freeze was collected
    assert got["enabled"] is True
