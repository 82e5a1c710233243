"""Flag value parsers: Go durations and booleans, host:port, ZeroMQ endpoints, env names."""

from __future__ import annotations

import pytest

from inferencecache.config import (
    env_name,
    format_duration,
    is_loopback_host,
    parse_duration,
    parse_go_bool,
    parse_host_port,
    parse_zmq_endpoint,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0", 0.0),
        ("100ms", 0.1),
        ("1.5s", 1.5),
        ("1m30s", 90.0),
        ("2h", 7200.0),
        ("-3s", -3.0),
        ("+5m", 300.0),
        ("250us", 250e-6),
        ("250µs", 250e-6),
        ("7ns", 7e-9),
        (".5s", 0.5),
        ("1h2m3.5s", 3723.5),
    ],
)
def test_go_durations_parse(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["10", "", "s", "1x", "1.5", "--1s", "1s2", "1 s", "-"])
def test_bad_durations_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_format_duration_round_trips_common_values() -> None:
    for seconds in (0.0, 0.1, 1.5, 90.0, 1800.0, 7200.0):
        assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.05, "50ms"), (0.5, "500ms"), (2.0, "2s"), (90.0, "90s"), (600.0, "10m"),
     (1800.0, "30m"), (7200.0, "2h"), (250e-6, "250us"), (1e-9, "0.001us"), (1e-5, "10us"),
     (0.0001234, "123.4us"), (-2.0, "-2s")],
)
def test_format_duration_is_go_syntax(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    "seconds", [1e-9, 3e-7, 1e-5, 0.05, 0.1, 0.3, 1.1, 2.5, 59.999, 123456.789, 1e20, -0.25]
)
def test_format_duration_round_trips_exactly(seconds: float) -> None:
    """--help shows defaults with it: the text must parse back to the very same float."""
    text = format_duration(seconds)
    assert "e" not in text.rstrip("s").lower().replace("µ", "")
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["1", "t", "T", "true", "TRUE", "True"])
def test_go_true(text: str) -> None:
    assert parse_go_bool(text) is True


@pytest.mark.parametrize("text", ["0", "f", "F", "false", "FALSE", "False"])
def test_go_false(text: str) -> None:
    assert parse_go_bool(text) is False


@pytest.mark.parametrize("text", ["yes", "no", "on", "", "2", "tru"])
def test_go_bool_rejects_others(text: str) -> None:
    with pytest.raises(ValueError):
        parse_go_bool(text)


def test_host_port_forms() -> None:
    hp = parse_host_port("127.0.0.1:9090")
    assert (hp.host, hp.port, hp.is_loopback) == ("127.0.0.1", 9090, True)
    v6 = parse_host_port("[::1]:8080")
    assert (v6.host, v6.port, v6.is_loopback, str(v6)) == ("::1", 8080, True, "[::1]:8080")
    assert parse_host_port("localhost:1").is_loopback
    assert not parse_host_port("0.0.0.0:1").is_loopback
    assert not parse_host_port(":8080").is_loopback
    assert not parse_host_port("10.1.2.3:80").is_loopback


@pytest.mark.parametrize(
    "text", ["9090", "host", "host:", "host:x", "host:70000", "a:b:c", "[::1]"]
)
def test_bad_host_ports(text: str) -> None:
    with pytest.raises(ValueError):
        parse_host_port(text)


def test_loopback_hosts() -> None:
    assert is_loopback_host("127.0.0.2")
    assert is_loopback_host("::1")
    assert not is_loopback_host("example.com")


@pytest.mark.parametrize(
    "text", ["tcp://127.0.0.1:5557", "tcp://*:5557", "ipc:///tmp/x.sock", "inproc://a"]
)
def test_zmq_endpoints(text: str) -> None:
    assert parse_zmq_endpoint(text) == text


@pytest.mark.parametrize(
    "text", ["127.0.0.1:5557", "tcp://127.0.0.1", "http://x:1", "tcp://:5557", "tcp://h:99999"]
)
def test_bad_zmq_endpoints(text: str) -> None:
    with pytest.raises(ValueError):
        parse_zmq_endpoint(text)


def test_env_names() -> None:
    assert env_name("grpc-address") == "INFERENCECACHE_GRPC_ADDRESS"
    assert env_name("--block-size") == "INFERENCECACHE_BLOCK_SIZE"
