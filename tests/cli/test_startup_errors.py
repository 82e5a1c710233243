"""Start-up problems exit 2 with one line naming the flag, before the command does anything:
unwritable ``--out`` of ``simulate``/``demo``, ``fake-engine``'s unreadable ``--script``, bad
``--tokenizer-dir`` and taken endpoints/addresses, ``subscribe``'s ``--engine-metrics-url`` and
``--log-level``. Real processes, real sockets, 127.0.0.1 only."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from inferencecache.procs import Child, free_port, run_cli
from inferencecache.subscriber.settings import SubscribeSettings

SMALL_SIM = ["--workload", "chat", "--policies", "round_robin", "--requests", "30",
             "--replicas", "2"]


def one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on (127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


# ---- simulate / demo --out ----------------------------------------------------------------------


def bad_out_dirs(tmp_path: Path) -> list[tuple[str, str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return [
        ("/dev/null/out", "is not a directory"),  # under a device file
        (str(a_file), "not a directory"),  # the path is a file
        (str(a_file / "sub" / "deeper"), "is not a directory"),  # under a regular file
    ]


@pytest.mark.parametrize("cmd", ["simulate", "demo"])
def test_unwritable_out_exits_2_before_the_run(cmd: str, tmp_path: Path) -> None:
    for out, reason in bad_out_dirs(tmp_path):
        started = time.monotonic()
        r = run_cli([cmd, *SMALL_SIM, "--out", out], timeout=60)
        assert r.returncode == 2, (out, r.stderr, r.stdout[-2000:])
        line = one_line(r.stderr)
        assert line.startswith(f"inferencecache {cmd}: error: --out {out!r}: "), line
        assert reason in line, line
        # Nothing ran: both commands print progress/results on stdout once they start.
        assert r.stdout == "", r.stdout[-2000:]
        assert time.monotonic() - started < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing created


def test_simulate_creates_a_missing_out_directory(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    r = run_cli(["simulate", *SMALL_SIM, "--out", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((out / "simulate-chat.json").read_text())
    assert doc["workload"] == "chat" and set(doc["policies"]) == {"round_robin"}
    assert (out / "simulate.png").stat().st_size > 0


# ---- fake-engine ---------------------------------------------------------------------------------

ENGINE = ["fake-engine", "--bind", "tcp://127.0.0.1:0", "--http-address", "127.0.0.1:0"]


@pytest.mark.parametrize("kind", ["missing", "directory", "under-a-file"])
def test_fake_engine_unreadable_script_exits_2(kind: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("{}\n")
    path = {"missing": tmp_path / "nope.jsonl", "directory": tmp_path,
            "under-a-file": tmp_path / "f" / "x.jsonl"}[kind]
    r = run_cli([*ENGINE, "--mode", "script", "--script", str(path)])
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert f"cannot read --script {str(path)!r}: " in line, line


def test_fake_engine_readable_script_runs(tmp_path: Path) -> None:
    """The control case: the same command with a readable script runs it (and exits 0)."""
    script = tmp_path / "s.jsonl"
    script.write_text('{"op": "store", "tokens": [1, 2, 3, 4]}\n{"op": "exit"}\n')
    r = run_cli([*ENGINE, "--mode", "script", "--script", str(script)])
    assert r.returncode == 0, r.stderr
    assert any(json.loads(x).get("msg") == "script step" for x in r.stderr.splitlines())


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_fake_engine_bad_tokenizer_dir_exits_2(kind: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    path = tmp_path / ("nope" if kind == "missing" else "f")
    r = run_cli([*ENGINE, "--mode", "simulated", "--tokenizer-dir", str(path)])
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert "--tokenizer-dir" in line and str(path) in line, line


@pytest.mark.parametrize("mode", ["fixed", "simulated"])
def test_fake_engine_http_address_in_use_exits_2(mode: str, taken_port: int) -> None:
    addr = f"127.0.0.1:{taken_port}"
    r = run_cli(["fake-engine", "--mode", mode, "--bind", "tcp://127.0.0.1:0",
                 "--http-address", addr])
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert f"cannot listen on --http-address {addr}: " in line and "in use" in line, line


@pytest.mark.parametrize("mode", ["fixed", "simulated"])
@pytest.mark.parametrize("flag", ["--bind", "--replay-endpoint"])
def test_fake_engine_zmq_endpoint_in_use_exits_2(mode: str, flag: str) -> None:
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    try:
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
        args = {"--bind": "tcp://127.0.0.1:0", "--http-address": "127.0.0.1:0"}
        args[flag] = endpoint
        r = run_cli(["fake-engine", "--mode", mode, *[x for kv in args.items() for x in kv]])
    finally:
        holder.close(linger=0)
        ctx.term()
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert line == (
        f"inferencecache fake-engine: error: cannot bind {flag} {endpoint}: "
        "Address already in use"
    ), line


def test_fake_engine_log_level_warn_drops_info_records(tmp_path: Path) -> None:
    script = tmp_path / "s.jsonl"
    script.write_text('{"op": "exit"}\n')
    args = [*ENGINE, "--mode", "script", "--script", str(script)]
    loud = run_cli(args)
    assert loud.returncode == 0
    assert "fake engine ready" in loud.stderr  # an INFO record by default
    for argv, env in (([*args, "--log-level", "warn"], None),
                      (args, {"INFERENCECACHE_LOG_LEVEL": "WARN"})):
        quiet = run_cli(argv, env=env)
        assert quiet.returncode == 0, quiet.stderr
        assert quiet.stderr == "", quiet.stderr


def test_simulated_engine_prefill_default_is_the_demos() -> None:
    with Child(*ENGINE, "--mode", "simulated") as engine:
        rec = engine.wait_log("simulated engine ready", timeout=30)
    from inferencecache.sim.cluster import DEFAULT_ENGINE

    assert rec["prefill_ms_per_token"] == DEFAULT_ENGINE.prefill_ms_per_token == 0.1
    assert rec["max_num_seqs"] == DEFAULT_ENGINE.max_num_seqs
    assert rec["decode_ms_per_token"] == DEFAULT_ENGINE.decode_ms_per_token


# ---- subscribe -----------------------------------------------------------------------------------

SUB = ["subscribe", "--replica-id", "r0", "--model-id", "m", "--engine-endpoint",
       "tcp://127.0.0.1:1", "--server", "127.0.0.1:1"]


@pytest.mark.parametrize(
    "url",
    ["garbage", "127.0.0.1:8000/metrics", "ftp://127.0.0.1/metrics", "http://", "http:///metrics",
     "http://127.0.0.1:99999/metrics", "http://127.0.0.1:x/metrics", "http://a b/metrics"],
)
def test_subscribe_bad_engine_metrics_url_exits_2(url: str) -> None:
    for argv, env in (([*SUB, "--engine-metrics-url", url], None),
                      (SUB, {"INFERENCECACHE_ENGINE_METRICS_URL": url})):
        r = run_cli(argv, env=env)
        assert r.returncode == 2, r.stderr
        line = one_line(r.stderr)
        assert line.startswith("inferencecache subscribe: error: --engine-metrics-url: "), line
        assert repr(url) in line


@pytest.mark.parametrize(
    "url", ["", "http://127.0.0.1:8000/metrics", "https://engine.example/metrics",
            "http://[::1]:8000/metrics", "http://localhost/metrics"]
)
def test_subscribe_good_engine_metrics_urls_are_accepted(url: str) -> None:
    s = SubscribeSettings(replica_id="r", model_id="m", engine_metrics_url=url)
    assert s.engine_metrics_url == url


def test_subscribe_metrics_address_in_use_exits_2(taken_port: int) -> None:
    addr = f"127.0.0.1:{taken_port}"
    r = run_cli([*SUB, "--engine-metrics-url", "", "--metrics-address", addr])
    assert r.returncode == 2, r.stderr
    assert one_line(r.stderr) == (
        f"inferencecache subscribe: error: cannot listen on --metrics-address {addr}: "
        "Address already in use"
    )


def test_subscribe_log_level_error_logs_nothing_at_info() -> None:
    port = free_port()
    with Child(*SUB, "--engine-metrics-url", "", "--metrics-address", f"127.0.0.1:{port}",
               "--log-level", "error", inherit=False) as sub:
        deadline = time.monotonic() + 20
        while True:  # serving /healthz = started (the start-up records would be INFO)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, sub.tail()
            time.sleep(0.1)
        assert sub.stop() == 0
    assert [r for r in sub.records if r.get("level") in ("INFO", "DEBUG", "WARN")] == []
    assert sub.tail() == []
