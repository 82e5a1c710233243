"""Writers of the exact ``EventBatch`` wire shape of a chosen engine release
(engine-events-and-subscriber.md §2.2-§2.5).

Used by the fake and simulated engines and by tests. Each :class:`WireFormat` records what that
release's msgspec classes write: arrays carry every declared field in declaration order, nil
included (msgspec ignores ``omit_defaults`` on ``array_like`` structs); maps write
``{"type": tag, ...}`` in declaration order and omit a field whose value equals its default
(``None``) unless the field has no default. Maps are encoded through msgspec structs built
from the release's field list, because msgspec sizes a struct's map header by its declared
field count (vLLM 0.33's 16-key BlockStored always gets a map16 header) and the bytes must match
the engines' own (a test re-encodes every fixture byte for byte).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

__all__ = [
    "DEFAULT_FORMAT",
    "FORMATS",
    "WireAllCleared",
    "WireEvent",
    "WireFormat",
    "WireRemoved",
    "WireStored",
    "encode_batch",
    "wire_format",
]

Hash = int | bytes


@dataclass(slots=True)
class WireStored:
    """A ``BlockStored`` as an engine holds it before encoding (raw hash values, every field)."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int] | list[list[int]] | None
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    cache_salt: str | None = None  # SGLang


@dataclass(slots=True)
class WireRemoved:
    """A ``BlockRemoved`` before encoding."""

    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(slots=True)
class WireAllCleared:
    """An ``AllBlocksCleared`` before encoding."""


WireEvent = WireStored | WireRemoved | WireAllCleared


@dataclass(frozen=True)
class WireFormat:
    """The wire shape one engine release writes (events, envelope, replay reply)."""

    name: str
    family: str  # "vllm" | "sglang"
    maps: bool  # tagged maps (True) or tagged arrays (False)
    envelope_slots: int  # 2 ([ts, events]) or 3 ([ts, events, rank])
    stored_fields: tuple[str, ...]
    removed_fields: tuple[str, ...]
    # Map form: fields declared without a default, written even when nil.
    stored_required: frozenset[str] = field(default_factory=frozenset)
    removed_required: frozenset[str] = field(default_factory=frozenset)
    # Replay replies carry a topic frame (vLLM 0.26+, SGLang 0.5.22+).
    replay_topic_frame: bool = False
    # SGLang 0.5.18-0.5.19: a salted store gets an 8th slot {"cache_salt": ...}.
    salt_slot: bool = False


_V09_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
_V0102_STORED = (*_V09_STORED, "medium")
_V014_STORED = (*_V0102_STORED, "lora_name")
_V017_STORED = (*_V014_STORED, "extra_keys")
_V020_STORED = (*_V017_STORED, "group_idx")
_V022_STORED = (*_V020_STORED, "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_V026_STORED = (*_V022_STORED, "locality")
_V029_STORED = (*_V026_STORED, "ownership")
_V030_STORED = (*_V029_STORED, "session_id")
_V033_STORED = (*_V030_STORED, "lookahead_token_ids")
_VLLM_STORED_REQUIRED = frozenset(
    ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
     "lora_name")
)
_VLLM_REMOVED_REQUIRED = frozenset(("block_hashes", "medium"))
_SGL_STORED = (*_V0102_STORED,)
_SGL_MAP_STORED = (*_SGL_STORED, "lora_name", "cache_salt", "session_id")
_SGL_STORED_REQUIRED = frozenset(
    ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
)
_SGL_REMOVED_REQUIRED = frozenset(("block_hashes",))


def _vllm_array(name: str, stored: tuple[str, ...], removed: tuple[str, ...],
                envelope: int = 3) -> WireFormat:
    return WireFormat(name, "vllm", False, envelope, stored, removed)


def _vllm_map(name: str, stored: tuple[str, ...], removed: tuple[str, ...],
              topic: bool) -> WireFormat:
    return WireFormat(name, "vllm", True, 3, stored, removed, _VLLM_STORED_REQUIRED,
                      _VLLM_REMOVED_REQUIRED, replay_topic_frame=topic)


FORMATS: Final[dict[str, WireFormat]] = {
    f.name: f
    for f in (
        _vllm_array("vllm-0.9", _V09_STORED, ("block_hashes",), envelope=2),
        _vllm_array("vllm-0.10.2", _V0102_STORED, ("block_hashes", "medium")),
        _vllm_array("vllm-0.14", _V014_STORED, ("block_hashes", "medium")),
        _vllm_array("vllm-0.17", _V017_STORED, ("block_hashes", "medium")),
        _vllm_array("vllm-0.20", _V020_STORED, ("block_hashes", "medium", "group_idx")),
        _vllm_array("vllm-0.22", _V022_STORED, ("block_hashes", "medium", "group_idx")),
        _vllm_map("vllm-0.24", _V022_STORED, ("block_hashes", "medium", "group_idx"), False),
        _vllm_map("vllm-0.26", _V026_STORED, ("block_hashes", "medium", "group_idx", "locality"),
                  True),
        _vllm_map("vllm-0.29", _V029_STORED,
                  ("block_hashes", "medium", "group_idx", "locality", "ownership"), True),
        _vllm_map("vllm-0.30", _V030_STORED,
                  ("block_hashes", "medium", "group_idx", "locality", "ownership"), True),
        _vllm_map("vllm-0.33", _V033_STORED,
                  ("block_hashes", "medium", "group_idx", "locality", "ownership"), True),
        WireFormat("sglang-0.5.18", "sglang", False, 3, _SGL_STORED, ("block_hashes", "medium"),
                   salt_slot=True),
        WireFormat("sglang-0.5.23", "sglang", True, 3, _SGL_MAP_STORED,
                   ("block_hashes", "medium"), _SGL_STORED_REQUIRED, _SGL_REMOVED_REQUIRED,
                   replay_topic_frame=True),
    )
}
DEFAULT_FORMAT: Final = "vllm-0.33"


def wire_format(name: str) -> WireFormat:
    """Look a format up by name (``vllm-0.9``, ``vllm-0.22``, ``vllm-0.33``, ``sglang-0.5.23``…)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown wire format {name!r} (choose from {', '.join(FORMATS)})"
        ) from None


_ENCODER: Final = msgspec.msgpack.Encoder()


@functools.cache
def _map_struct(tag: str, names: tuple[str, ...], required: frozenset[str]) -> Any:
    """A msgspec struct shaped like the engine's class: tagged, defaults omitted."""
    spec: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        (name, Any) if name in required else (name, Any, None) for name in names
    ]
    return msgspec.defstruct(tag, spec, tag=True, omit_defaults=True)


def _event_obj(ev: WireEvent, fmt: WireFormat) -> Any:
    if isinstance(ev, WireStored):
        tag, names, required = "BlockStored", fmt.stored_fields, fmt.stored_required
    elif isinstance(ev, WireRemoved):
        tag, names, required = "BlockRemoved", fmt.removed_fields, fmt.removed_required
    else:
        return {"type": "AllBlocksCleared"} if fmt.maps else ["AllBlocksCleared"]
    if fmt.maps:
        cls = _map_struct(tag, names, required)
        return cls(*[getattr(ev, name) for name in names])
    arr: list[Any] = [tag]
    arr.extend(getattr(ev, name) for name in names)
    if fmt.salt_slot and isinstance(ev, WireStored) and ev.cache_salt is not None:
        arr.append({"cache_salt": ev.cache_salt})
    return arr


def encode_batch(
    ts: float, events: Sequence[WireEvent], fmt: WireFormat | str = DEFAULT_FORMAT, rank: int = 0
) -> bytes:
    """Encode one ``EventBatch`` exactly as the chosen release writes it."""
    f = wire_format(fmt) if isinstance(fmt, str) else fmt
    objs = [_event_obj(ev, f) for ev in events]
    envelope: list[Any] = [float(ts), objs]
    if f.envelope_slots >= 3:
        envelope.append(rank)
    return _ENCODER.encode(envelope)
