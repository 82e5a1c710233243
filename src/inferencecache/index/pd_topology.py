"""Prefill/decode topologies (contract-and-index.md §5.14): the ``serve --pd-topology-file``
format, YAML or JSON.

A topology names which replicas prefill, which decode and which KV transport connects them. The
file is the source of truth for roles: nothing on the contract's ingest path carries a role
(docs/decisions.md), so the index learns roles only from here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TRANSPORTS = ("Mooncake", "NIXL", "Direct")
"""The contract's ``transport_hint`` values, spelled as the wire carries them."""

DEFAULT_HASH_SCHEME = "vllm"
_TOP = ("topologies",)
_FIELDS = ("name", "hash_scheme", "transport", "prefill", "decode")


class TopologyError(ValueError):
    """An invalid topology file; ``path`` names the offending field (empty: the whole file)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


@dataclass(frozen=True, slots=True)
class PDTopology:
    """One named prefill/decode fleet. ``hash_scheme`` is the fingerprint domain its prefixes are
    looked up in (``LookupPDRouteRequest`` carries none)."""

    name: str
    transport: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    hash_scheme: str = DEFAULT_HASH_SCHEME


Topologies = Mapping[str, PDTopology]


def parse_topology_document(doc: Any) -> dict[str, PDTopology]:
    """Topologies by name from a decoded document ``{topologies: [{name, transport, prefill,
    decode, hash_scheme?}]}``; raises ``TopologyError`` naming the first bad field."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise TopologyError("", "the top level must be a mapping with a 'topologies' list")
    for key in doc:
        if key not in _TOP:
            raise TopologyError(str(key), "unknown field")
    items = doc.get("topologies") or []
    if not isinstance(items, list):
        raise TopologyError("topologies", "must be a list")
    out: dict[str, PDTopology] = {}
    for i, item in enumerate(items):
        path = f"topologies[{i}]"
        if not isinstance(item, dict):
            raise TopologyError(path, "must be a mapping")
        for key in item:
            if key not in _FIELDS:
                raise TopologyError(f"{path}.{key}", "unknown field")
        name = _string(item.get("name"), f"{path}.name")
        if name in out:
            raise TopologyError(f"{path}.name", f"duplicate topology {name!r}")
        transport = _transport(item.get("transport"), f"{path}.transport")
        scheme = item.get("hash_scheme", DEFAULT_HASH_SCHEME)
        scheme = _string(scheme, f"{path}.hash_scheme")
        out[name] = PDTopology(
            name=name,
            transport=transport,
            prefill=_replicas(item.get("prefill"), f"{path}.prefill"),
            decode=_replicas(item.get("decode"), f"{path}.decode"),
            hash_scheme=scheme,
        )
    return out


def load_topology_file(path: str | Path) -> dict[str, PDTopology]:
    """Read ``--pd-topology-file``: JSON when the name ends in ``.json``, else YAML."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TopologyError("", f"cannot read topology file {str(p)!r}: {e}") from None
    try:
        doc = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        one_line = " ".join(str(e).split())
        raise TopologyError("", f"topology file {str(p)!r} is not valid: {one_line}") from None
    return parse_topology_document(doc)


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise TopologyError(path, "must be a non-empty string")
    return value


def _transport(value: Any, path: str) -> str:
    if isinstance(value, str):
        for t in TRANSPORTS:
            if value.lower() == t.lower():
                return t
    raise TopologyError(path, f"must be one of {', '.join(TRANSPORTS)}")


def _replicas(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise TopologyError(path, "must be a non-empty list of replica ids")
    seen: list[str] = []
    for j, rid in enumerate(value):
        rid = _string(rid, f"{path}[{j}]")
        if rid in seen:
            raise TopologyError(f"{path}[{j}]", f"duplicate replica {rid!r}")
        seen.append(rid)
    return tuple(seen)
