"""Access to the committed KV-event fixtures (tests/fixtures/vllm_kv_events)."""

from __future__ import annotations

import base64
import json
from functools import cache
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_kv_events"


@cache
def manifest() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "manifest.json").read_text())
    return data


def entries() -> list[dict[str, Any]]:
    return list(manifest()["fixtures"])


def entry(name: str) -> dict[str, Any]:
    for f in entries():
        if f["file"] == name:
            return f
    raise KeyError(name)


def payload(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def capture(name: str) -> list[dict[str, Any]]:
    """A live capture: one dict per frame set, with ``payload`` bytes added."""
    out = []
    for line in (FIXTURES / name).read_text().splitlines():
        if line.strip():
            obj = json.loads(line)
            obj["payload"] = base64.b64decode(obj["payload_b64"])
            out.append(obj)
    return out
