"""The warm-worker zygote: a forked rank behaves as a fresh interpreter would (argv, env, streams, exit status)."""

import json
import os
import signal
import socket
import subprocess
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
    _, rc, out, _ = _run(zygote, "json.tool", ["--sort-keys", str(src)])
    assert rc == 0
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


def test_an_exit_status_that_came_with_the_pid_is_what_wait_returns():
    from afd_sdk.runtime.zygote import WarmProcess

    dead = subprocess.Popen(["true"])
    dead.wait()
    ours, zygote_end = socket.socketpair()
    zygote_end.close()  # the zygote closes the connection once it has reported the status
    # a rank that ended at once: "pid N\nrc 3\n" arrived in one read, the rest handed over with the pid
    proc = WarmProcess(ours, dead.pid, b"rc 3\n")
    assert proc.wait(timeout=5) == 3


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
    assert not zygote.eligible(
        "afd_sdk.runtime.worker", {**env, "HF_HUB_OFFLINE": "0" if env.get("HF_HUB_OFFLINE") == "1" else "1"}
    )


_PROBE = """
import os, signal, sys
from afd_sdk.runtime.world import worker_main

def run(spec, out):
    out.update(ppid=os.getppid(), sigpipe_ignored=signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN)
    if spec.get("exit") is not None:
        sys.exit(spec["exit"])

sys.exit(worker_main(run, sys.argv))
"""


def test_run_world_forks_from_the_zygote_as_a_fresh_interpreter_would(zygote, tmp_path, monkeypatch):
    from afd_sdk.runtime import zygote as zygote_module
    from afd_sdk.runtime.world import run_world

    (tmp_path / "afd_zygote_world_probe.py").write_text(_PROBE)
    monkeypatch.chdir(tmp_path)  # python -m finds the probe in its working directory; so does the fork
    monkeypatch.setattr(zygote_module, "_active", zygote)
    spec = {"afd": {"num_attention_ranks": 1, "num_ffn_ranks": 1}}
    world = run_world(spec, module="afd_zygote_world_probe", timeout_s=60, roles=("attention",))
    (rank,) = world.ranks
    assert rank.ok, world.describe()
    assert rank.result["ppid"] == zygote._proc.pid  # forked by the zygote, not started by this process
    assert rank.result["sigpipe_ignored"] is True  # as in a fresh interpreter: a closed socket raises
    assert "RuntimeWarning" not in rank.stderr  # runpy's "found in sys.modules": nothing run as main is preloaded
    # exit statuses as Popen reports them, also for a rank that ends at once (its status may come with its pid)
    for code, expected in ((3, 3), (-1, 255)):
        world = run_world({**spec, "exit": code}, module="afd_zygote_world_probe", timeout_s=60, roles=("attention",))
        assert world.ranks[0].returncode == expected, world.describe()
