"""``inferencecache subscribe`` as a process: start-up log, SIGTERM shutdown, exit codes."""

from __future__ import annotations

import socket
import urllib.request

from inferencecache.procs import Child, run_cli

BASE = ["subscribe", "--replica-id", "r0", "--model-id", "m", "--engine-metrics-url", "",
        "--engine-endpoint", "tcp://127.0.0.1:1", "--server", "127.0.0.1:1"]


def test_starts_serves_health_and_stops_cleanly_on_sigterm() -> None:
    with Child(*BASE, "--metrics-address", "127.0.0.1:0") as sub:
        start = sub.wait_log("kvevent-subscriber starting")
        for key in ("engine_endpoint", "server", "replica_id", "model_id", "engine_metrics_url",
                    "stats_interval", "cache_tier", "engine_model_name", "ignore_block_removed"):
            assert key in start
        address = sub.wait_log("metrics listening")["address"]
        sub.wait_log("subscribed to engine KV events")
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=5) as r:
            assert r.status == 200 and r.read() == b"ok"
        assert sub.stop() == 0
        assert sub.count("kvevent-subscriber stopped") == 1


def test_metrics_address_in_use_exits_2_with_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        r = run_cli([*BASE, "--metrics-address", address])
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"--metrics-address {address}" in r.stderr and "in use" in r.stderr
