"""``inferencecache.procs``: children are stopped by their own PID, bounded, even when they
ignore SIGTERM or a stop fails; settings do not leak into a clean environment."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from inferencecache.procs import KEEP_ENV, Child, ChildFailed, Children, child_env

IGNORES_SIGTERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_child_env_drops_settings_but_keeps_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERENCECACHE_BLOCK_SIZE", "64")
    monkeypatch.setenv("INFERENCECACHE_TEST_MARKER", "m1")
    env = child_env({"INFERENCECACHE_ROUTING_POLICY": "random"})
    assert "INFERENCECACHE_BLOCK_SIZE" not in env
    assert env["INFERENCECACHE_TEST_MARKER"] == "m1"
    assert env["INFERENCECACHE_ROUTING_POLICY"] == "random"
    assert "INFERENCECACHE_TEST_MARKER" in KEEP_ENV
    assert "INFERENCECACHE_TEST_MARKER" not in child_env(keep=())


def test_a_child_ignoring_sigterm_is_killed_after_the_bounded_wait() -> None:
    with Children(stop_timeout=0.5) as children:
        p = children.popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE,
                           text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        children.stop_all()
        assert p.returncode == -9  # SIGKILL after SIGTERM was ignored
        assert time.monotonic() - t0 < 0.5 + 5.0 + 1.0


def test_stop_all_together_stops_and_reaps_every_child() -> None:
    children = Children(stop_timeout=0.5, together=True)
    procs = [children.popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(3)]
    children.stop_all()
    assert [p.returncode for p in procs] == [-15, -15, -15]  # SIGTERM, each reaped


def test_wait_log_reports_an_exited_child_with_its_last_lines() -> None:
    with Child("no-such-command", inherit=False) as child, pytest.raises(ChildFailed) as e:
        child.wait_log("serving", timeout=30)
    assert "exited with 2" in str(e.value) and "no-such-command" in str(e.value)
