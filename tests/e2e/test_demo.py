"""``inferencecache demo`` end to end, small: the JSON it writes, and that every process it
started is gone afterwards (also after SIGTERM mid-run)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from inferencecache.sim.report import is_document

pytestmark = pytest.mark.e2e

SMALL = ["--requests", "24", "--replicas", "2", "--gateways", "1", "--request-rate", "20"]


def marked(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``marker`` (the demo's children)."""
    out = []
    needle = f"INFERENCECACHE_TEST_MARKER={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if needle in env.split(b"\0") and ") Z " not in stat:  # zombies are gone already
            out.append(int(entry))
    return out


def demo(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    marker = uuid.uuid4().hex
    env = {**os.environ, "INFERENCECACHE_TEST_MARKER": marker, "PYTHONUNBUFFERED": "1",
           "COLUMNS": "120"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferencecache.cli", "demo", *args, "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    return proc, marker


def stop(proc: subprocess.Popen[str], marker: str) -> None:
    """The demo by its PID, then any child of it still alive (a failed test must not leave a
    cluster behind), each by its own PID."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    for pid in marked(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_gone(marker: str, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    left = marked(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked(marker)
    return left


def test_demo_writes_the_results_and_leaves_no_process(tmp_path: Path) -> None:
    proc, marker = demo(tmp_path, *SMALL, "--policies", "round_robin,cache_aware,oracle")
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        stop(proc, marker)
    assert proc.returncode == 0, out[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert is_document(doc), doc
    assert doc["workload"] == "chat"
    assert list(doc["policies"]) == ["round_robin", "cache_aware", "oracle"]
    for name, s in doc["policies"].items():
        assert 0 < s["requests"] <= 24, (name, s)
        assert 0.0 <= s["hit_rate"] <= 1.0
        assert 0 < s["ttft_p50_ms"] <= s["ttft_p90_ms"]
    assert doc["policies"]["cache_aware"]["hint_overhead_p50_ms"] > 0
    assert doc["policies"]["round_robin"]["hint_overhead_p50_ms"] == 0
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "cache_aware" in out and "every process it started is stopped" in out
    assert wait_gone(marker) == []


def test_demo_on_the_event_log_adds_the_in_process_replica_row(tmp_path: Path) -> None:
    """``demo --event-log``: the server on a private redis-server's log, and cache_aware once
    through gRPC and once from a replica inside the gateway; Redis is stopped with the rest."""
    proc, marker = demo(tmp_path, *SMALL, "--policies", "cache_aware", "--event-log")
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        stop(proc, marker)
    assert proc.returncode == 0, out[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert list(doc["policies"]) == ["cache_aware", "cache_aware (in-process replica)"]
    for s in doc["policies"].values():
        assert 0 < s["requests"] <= 24
        assert s["hint_overhead_p50_ms"] > 0
    assert wait_gone(marker) == []  # redis-server too


def test_sigterm_mid_run_stops_every_process(tmp_path: Path) -> None:
    proc, marker = demo(tmp_path, *SMALL, "--requests", "400", "--policies", "round_robin")
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        seen = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
            if "cluster up" in line:
                break
        assert "cluster up" in seen, seen
        assert len(marked(marker)) >= 5  # server, 2 engines, 2 subscribers (+ gateway)
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        stop(proc, marker)
    assert proc.returncode != 0
    assert "interrupted" in out
    assert wait_gone(marker) == []
    assert not (tmp_path / "results.json").exists()
