"""JSON-lines logging on stderr (time, level, msg, then attributes), like the Go reference.

Attributes travel in ``extra=``: ``log.warning("zmq dial failed; retrying", extra={"err": e})``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
_LEVELS = {
    "DEBUG": "DEBUG",
    "INFO": "INFO",
    "WARNING": "WARN",
    "ERROR": "ERROR",
    "CRITICAL": "ERROR",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line; non-JSON attribute values are rendered with ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": _LEVELS.get(record.levelname, record.levelname),
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def python_level(level: str | int) -> str | int:
    """A ``--log-level`` value (``debug``, ``info``, ``warn``/``warning``, ``error``, any case)
    as a :mod:`logging` level."""
    if isinstance(level, int):
        return level
    name = level.upper()
    return "WARNING" if name == "WARN" else name


def setup(level: str | int = "INFO") -> None:
    """Route the root logger to stderr as JSON lines at ``level`` (a ``--log-level`` value or a
    :mod:`logging` level; idempotent)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_inferencecache", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler._inferencecache = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(python_level(level))
