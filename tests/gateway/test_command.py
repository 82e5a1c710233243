"""``inferencecache gateway`` as a process: flags, env vars, one-line errors, clean shutdown."""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from inferencecache.procs import Child, run_cli
from tests.gateway.support import client, engines, post


def gateway(args: list[str], env: dict[str, str] | None = None) -> Child:
    """A running ``inferencecache gateway`` with exactly these flags and settings."""
    return Child("gateway", *args, env=env, inherit=False)


async def test_gateway_process_serves_and_stops_on_sigterm():
    async with engines("a") as stubs:
        gw = gateway(
            ["--http-address", "127.0.0.1:0", "--engines", f"r0={stubs[0].url}",
             "--server", "127.0.0.1:1", "-health-interval=1s"],
            env={"INFERENCECACHE_ROUTING_POLICY": "round_robin"},
        )
        try:
            rec = await asyncio.to_thread(gw.wait_log, "serving")
            assert rec["routing_policy"] == "round_robin"  # from the environment
            assert rec["engines"] == {"r0": stubs[0].url}
            port = int(rec["http_address"].rsplit(":", 1)[1])
            assert port > 0
            async with client() as c:
                status, headers, body = await post(
                    c, f"http://127.0.0.1:{port}", {"model": "m", "prompt": [1, 2, 3]}
                )
                assert status == 200 and body["served_by"] == "a"
                assert headers["X-Cache-Route-Reason"] == "ROUND_ROBIN"
            gw.signal(signal.SIGTERM)
            await asyncio.to_thread(gw.wait_log, "stopped")
            assert await asyncio.to_thread(gw.wait, 10) == 0
        finally:
            gw.stop()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "Missing option '--engines'"),
        (["--engines", "nope"], "--engines: item 'nope' is not replica_id=http://host:port"),
        (["--engines", "r0=http://a:1,r0=http://b:2"], "duplicate replica id 'r0'"),
        (["--engines", "r0=http://a:1", "--block-size", "0"], "--block-size must be >= 1"),
        (["--engines", "r0=http://a:1", "--lookup-timeout", "0"], "--lookup-timeout must be > 0"),
        (["--engines", "r0=http://a:1", "--lookup-timeout", "50"], "invalid duration"),
        (["--engines", "r0=http://a:1", "--routing-policy", "lru"], "'lru' is not one of"),
        (["--engines", "r0=http://a:1", "--routing-policy", "approximate",
          "--routing-params", "capacity_blocks=x"], "not a valid int"),
        (["--engines", "r0=http://a:1", "--tenant-header", "bad header"], "not a header name"),
        (["--engines", "r0=http://a:1", "--adapters", "x"], "--adapters: item 'x'"),
        (["--engines", "r0=http://a:1", "--tokenizer-dir", "/nonexistent/dir"],
         "--tokenizer-dir"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, needle):
    done = run_cli(["gateway", *args], timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("inferencecache gateway: error: ")
    assert needle in lines[0]


def test_env_var_errors_name_the_flag():
    done = run_cli(["gateway"], env={"INFERENCECACHE_ENGINES": "r0=http://a:1",
                                     "INFERENCECACHE_BLOCK_SIZE": "-3"})
    assert done.returncode == 2
    assert "--block-size must be >= 1" in done.stderr


def test_address_in_use_exits_2():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        port = s.getsockname()[1]
        done = run_cli(
            ["gateway", "--engines", "r0=http://127.0.0.1:1", "--http-address",
             f"127.0.0.1:{port}"]
        )
        assert done.returncode == 2
        assert "cannot listen on --http-address" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    finally:
        s.close()


def test_help_lists_every_flag():
    done = run_cli(["gateway", "--help"])
    assert done.returncode == 0
    for flag in ("--engines", "--http-address", "--server", "--lookup-timeout",
                 "--routing-policy", "--tenant-header", "--tenant-id", "--hash-scheme",
                 "--block-size", "--tokenizer-dir", "--adapters", "INFERENCECACHE_ENGINES"):
        assert flag in done.stdout
