"""The warm-worker zygote: a forked rank behaves as a fresh interpreter would (argv, env, streams, exit status)."""

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from afd_sdk.runtime.zygote import Zygote


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.stop()


def _run(zygote, module, args, env=None, timeout=60):
    err = tempfile.TemporaryFile()
    out = tempfile.TemporaryFile()
    proc = zygote.spawn(module, args, env=env or dict(os.environ), stdout=out, stderr=err)
    rc = proc.wait(timeout=timeout)
    out.seek(0)
    err.seek(0)
    return proc, rc, out.read().decode(), err.read().decode()


def test_forked_child_runs_the_module_with_argv_and_streams(zygote, tmp_path):
    src = tmp_path / "in.json"
    src.write_text('{"b": 1, "a": [2]}')
    proc, rc, out, _ = _run(zygote, "json.tool", ["--sort-keys", str(src)])
    assert rc == 0 and proc.pid != os.getpid()
    assert json.loads(out) == {"a": [2], "b": 1}


def test_exit_status_and_stderr_come_back(zygote, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    _, rc, _, err = _run(zygote, "json.tool", [str(bad)])
    assert rc == 1 and "Expecting property name" in err


def test_environment_cwd_and_session_are_the_requesters(zygote, tmp_path):
    (tmp_path / "afd_zygote_probe.py").write_text(
        "import json, os, sys\n"
        "print(json.dumps([os.environ.get('AFD_PROBE'), os.getcwd(), sys.argv[1:], os.getsid(0) == os.getpid()]))\n"
    )
    env = {**os.environ, "AFD_PROBE": "seen"}
    out = tempfile.TemporaryFile()
    proc = zygote.spawn("afd_zygote_probe", ["x", "y"], env=env, stdout=out, stderr=None, cwd=str(tmp_path))
    assert proc.wait(timeout=30) == 0
    out.seek(0)
    assert json.loads(out.read()) == ["seen", str(tmp_path), ["x", "y"], True]


def test_kill_reports_the_signal_like_popen(zygote):
    err = tempfile.TemporaryFile()
    proc = zygote.spawn("http.server", ["0", "--bind", "127.0.0.1"], env=dict(os.environ), stdout=err, stderr=err)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # a session of its own, as run_world's killpg expects
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_eligibility(zygote):
    env = dict(os.environ)
    assert zygote.eligible("afd_sdk.runtime.worker", env)
    assert not zygote.eligible("afd_sdk.integrations.vllm.worker", env)
    assert not zygote.eligible("afd_sdk.runtime.worker", {**env, "PYTHONPATH": "/elsewhere"})
    assert zygote.eligible("afd_sdk.runtime.worker", {**env, "AFD_ANYTHING": "1", "TORCHINDUCTOR_CACHE_DIR": "/x"})
    assert sys.executable
