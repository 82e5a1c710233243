"""Parsers for flag values, in the Go reference's syntax so manifests stay portable."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

_UNITS = {
    "ns": Fraction(1, 10**9),
    "us": Fraction(1, 10**6),
    "µs": Fraction(1, 10**6),  # U+00B5 micro sign
    "μs": Fraction(1, 10**6),  # U+03BC greek mu
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    "m": Fraction(60),
    "h": Fraction(3600),
}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Parse a Go duration string (``100ms``, ``1.5s``, ``1m30s``, ``-2h``, ``0``) into seconds.

    A bare number other than ``0`` is invalid, exactly as in Go, so ``--window 10`` is an error
    instead of silently meaning ten nanoseconds or ten seconds.
    """
    s = text.strip()
    if not s:
        raise ValueError(f"invalid duration {text!r}")
    sign = 1.0
    if s[0] in "+-":
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:]
    if s == "0":
        return 0.0
    if not s:
        raise ValueError(f"invalid duration {text!r}")
    total = Fraction(0)  # exact, so "10us" is the float nearest 1e-5 (10 * 1e-6 is not)
    pos = 0
    while pos < len(s):
        m = _PART.match(s, pos)
        if m is None:
            raise ValueError(f"invalid duration {text!r} (use a unit: ns, us, ms, s, m, h)")
        total += Fraction(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    return sign * float(total)


def format_duration(seconds: float) -> str:
    """Render seconds as a Go duration that :func:`parse_duration` reads back to ``seconds``
    exactly (help texts show defaults this way; logs use it too): ``50ms``, ``2s``, ``30m``."""
    if seconds == 0:
        return "0s"
    candidate = _short_duration(seconds)
    if candidate is not None and parse_duration(candidate) == seconds:
        return candidate
    # Exact fallback: the shortest decimal that round-trips the float, never in e-notation.
    return f"{Decimal(repr(float(seconds))):f}s"


def _short_duration(seconds: float) -> str | None:
    if abs(seconds) < 1e-3:
        value, unit = seconds * 1e6, "us"
    elif abs(seconds) < 1:
        value, unit = seconds * 1000, "ms"
    elif abs(seconds) < 60 or seconds % 60:
        value, unit = seconds, "s"
    elif seconds % 3600:
        value, unit = seconds / 60, "m"
    else:
        value, unit = seconds / 3600, "h"
    text = f"{value:g}"
    return None if "e" in text or "n" in text else text + unit


_GO_INT = re.compile(r"[+-]?[0-9]+\Z", re.ASCII)
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1


def is_go_int(text: str) -> bool:
    """An optional sign and ASCII digits only (``int()`` alone would also take ``1_0``, spaces
    and non-ASCII digits); the range is not checked."""
    return _GO_INT.match(text) is not None


def parse_go_int(text: str) -> int:
    """Go's ``strconv.Atoi``: :func:`is_go_int` syntax within int64, else ``ValueError``."""
    if not is_go_int(text):
        raise ValueError(f"invalid integer {text!r}")
    n = int(text)
    if not _I64_MIN <= n <= _I64_MAX:
        raise ValueError(f"integer {text!r} is out of int64 range")
    return n


_TRUE = {"1", "t", "true", "TRUE", "True", "T"}
_FALSE = {"0", "f", "false", "FALSE", "False", "F"}


def parse_go_bool(text: str) -> bool:
    """Go's strconv.ParseBool: 1/t/T/TRUE/true/True and their false twins; nothing else."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"invalid boolean {text!r} (use true or false)")


@dataclass(frozen=True)
class HostPort:
    """A ``host:port`` listen or dial address; IPv6 hosts are written ``[::1]:9090``."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)


def parse_host_port(text: str) -> HostPort:
    """Parse ``host:port`` (port 0-65535; host may be empty for "all interfaces")."""
    s = text.strip()
    if s.startswith("["):
        end = s.find("]")
        if end < 0 or not s[end + 1 :].startswith(":"):
            raise ValueError(f"invalid address {text!r} (want host:port)")
        host, port_s = s[1:end], s[end + 2 :]
    else:
        host, sep, port_s = s.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"invalid address {text!r} (want host:port)")
    if not port_s.isascii() or not port_s.isdigit():
        raise ValueError(f"invalid address {text!r} (port must be a number)")
    port = int(port_s)
    if port > 65535:
        raise ValueError(f"invalid address {text!r} (port out of range)")
    if host and not re.fullmatch(r"[A-Za-z0-9.\-_:%]+", host):
        raise ValueError(f"invalid address {text!r} (bad host)")
    return HostPort(host, port)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IPs; an empty host or a wildcard is not loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


_ZMQ = re.compile(r"^(tcp|ipc|inproc|pgm|epgm|udp|ws|wss)://(.+)$")


def parse_zmq_endpoint(text: str) -> str:
    """Check a ZeroMQ endpoint (``tcp://host:port``, ``ipc://path``, ``inproc://name``)."""
    m = _ZMQ.match(text.strip())
    if m is None:
        raise ValueError(f"invalid ZeroMQ endpoint {text!r} (want e.g. tcp://127.0.0.1:5557)")
    scheme, rest = m.group(1), m.group(2)
    if scheme in ("tcp", "udp", "ws", "wss", "pgm", "epgm"):
        addr = rest.split("/", 1)[0] if scheme in ("ws", "wss") else rest
        # libzmq also accepts "iface;host:port" source-address syntax; validate the target.
        target = addr.rsplit(";", 1)[-1]
        host, sep, port = target.rpartition(":")
        if not sep or not host or not (port.isascii() and (port.isdigit() or port == "*")):
            raise ValueError(f"invalid ZeroMQ endpoint {text!r} (want {scheme}://host:port)")
        if port.isdigit() and int(port) > 65535:
            raise ValueError(f"invalid ZeroMQ endpoint {text!r} (port out of range)")
    return text.strip()
