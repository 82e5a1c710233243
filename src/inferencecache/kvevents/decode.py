"""Tolerant decoder for engine ``EventBatch`` payloads
(engine-events-and-subscriber.md §2.2-§2.5, §3.3).

One batch is atomic: any error rejects the whole batch with a short ``reason`` (a metric label)
and nothing of it is applied. What is accepted:

* envelope: an array ``[ts, events, ...]`` of length ≥ 2 (extra slots ignored) or a map with ``ts``
  and ``events``; ``ts`` an int or float (never nil or bool);
* events: tagged arrays (vLLM ≤ 0.23, SGLang ≤ 0.5.19) and tagged maps (vLLM ≥ 0.24, SGLang ≥
  0.5.20), chosen per event; unknown map keys and extra trailing slots are ignored, unknown tags are
  skipped;
* the field rules of engine-events-and-subscriber.md §3.3 (exact msgpack int types: ``bool`` is
  never an int, floats never are).

Two implementations with identical results: :func:`decode_untyped` is the reference (untyped
msgpack, then explicit checks; handles every shape) and :class:`BatchDecoder` first tries
msgspec typed decoders for the two common shapes (about twice as fast: the per-token checks run
in C) and falls back to the reference for anything they do not accept. A property test keeps the
two identical.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec
from msgspec.structs import astuple

from inferencecache.kvevents.events import (
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    Event,
    normalize_medium,
)
from inferencecache.kvevents.hashes import normalize_hash
from inferencecache.kvevents.packed import TokenIds, hash_keys, token_array

__all__ = [
    "REJECT_REASONS",
    "BatchDecoder",
    "BatchRejected",
    "decode_batch",
    "decode_untyped",
]

U32_LIMIT: Final = 1 << 32
I64_MIN: Final = -(1 << 63)
I64_MAX: Final = (1 << 63) - 1
BLOCK_SIZE_LIMIT: Final = 1 << 31

STORED: Final = "BlockStored"
REMOVED: Final = "BlockRemoved"
CLEARED: Final = "AllBlocksCleared"

# Every value BatchRejected.reason can take (bounded: it is a metric label).
REJECT_REASONS: Final = (
    "msgpack",  # not msgpack / truncated
    "envelope",  # envelope shape, ts, events container
    "event",  # event shape, tag type, missing required field, too few slots
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
)


class BatchRejected(ValueError):
    """The whole batch is invalid; ``reason`` is one of :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# Field checks shared by both implementations


def _check_block_size(block_size: int, has_tokens: bool, medium: str | None) -> None:
    """``[1, 2^31)``, or 0 for a connector placeholder (no tokens, non-GPU medium,
    engine-events-and-subscriber.md §2.4)."""
    if 1 <= block_size < BLOCK_SIZE_LIMIT:
        return
    if block_size == 0 and not has_tokens and normalize_medium(medium) != GPU:
        return
    raise BatchRejected("block_size", f"block_size {block_size} out of range")


# ---------------------------------------------------------------------------------------------
# Reference implementation: untyped msgpack + explicit checks

_UNTYPED: Final = msgspec.msgpack.Decoder()
_MISSING: Final = object()


def _hash(value: Any, field: str) -> bytes:
    try:
        return normalize_hash(value)
    except TypeError:
        raise BatchRejected(field, f"{field} element of type {type(value).__name__}") from None


def _hash_list(value: Any) -> list[bytes]:
    if value is None:
        return []
    if type(value) is not list:
        raise BatchRejected("block_hashes", f"block_hashes is {type(value).__name__}")
    return [_hash(v, "block_hashes") for v in value]


_BIGRAM: Final[list[int]] = []


def _token_ids(value: Any) -> list[int]:
    """Validated token ids, or the :data:`_BIGRAM` sentinel for EAGLE ``[a, b]`` pair keys."""
    if value is None:
        return []
    if type(value) is not list:
        raise BatchRejected("token_ids", f"token_ids is {type(value).__name__}")
    if not value:
        return []
    types = set(map(type, value))
    if types == {int}:
        if min(value) < 0 or max(value) >= U32_LIMIT:
            raise BatchRejected("token_ids", "token id outside [0, 2^32)")
        return value
    if list in types:
        return _BIGRAM
    bad = next(t for t in types if t is not int)
    raise BatchRejected("token_ids", f"token id of type {bad.__name__}")


def _lora_id(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is int and I64_MIN <= value <= I64_MAX:
        return int(value)
    raise BatchRejected("lora_id", f"lora_id {value!r:.40} is not an int64")


def _opt_str(value: Any, field: str, ignored: list[str]) -> str | None:
    if value is None or type(value) is str:
        return value  # type: ignore[no-any-return]
    ignored.append(field)
    return None


def _opt_int(value: Any, field: str, ignored: list[str]) -> int | None:
    if value is None or type(value) is int:
        return value  # type: ignore[no-any-return]
    ignored.append(field)
    return None


def _stored(get: Any, ignored: list[str]) -> BlockStored:
    """Build a BlockStored from ``get(field_name)`` (absent fields read as ``_MISSING``)."""
    hashes = _hash_list(get("block_hashes"))
    parent_raw = get("parent_block_hash")
    parent = None if parent_raw is None or parent_raw is _MISSING else _hash(
        parent_raw, "parent_block_hash"
    )
    tokens = _token_ids(get("token_ids"))
    bigram = tokens is _BIGRAM
    block_size = get("block_size")
    if type(block_size) is not int:
        raise BatchRejected("block_size", f"block_size of type {type(block_size).__name__}")
    lora_raw = get("lora_id")
    lora_id = _lora_id(None if lora_raw is _MISSING else lora_raw)

    def opt(name: str) -> Any:
        v = get(name)
        return None if v is _MISSING else v

    medium = _opt_str(opt("medium"), "medium", ignored)
    lora_name = _opt_str(opt("lora_name"), "lora_name", ignored)
    group_idx = _opt_int(opt("group_idx"), "group_idx", ignored)
    kind = _opt_str(opt("kv_cache_spec_kind"), "kv_cache_spec_kind", ignored)
    _check_block_size(block_size, bigram or bool(tokens), medium)
    return BlockStored(
        hashes,
        parent,
        TokenIds(() if bigram else tokens),
        block_size,
        lora_id,
        medium,
        lora_name,
        group_idx,
        kind,
        bigram,
    )


def _removed(get: Any, ignored: list[str]) -> BlockRemoved:
    hashes = _hash_list(get("block_hashes"))
    medium = get("medium")
    group_idx = get("group_idx")
    return BlockRemoved(
        hashes,
        _opt_str(None if medium is _MISSING else medium, "medium", ignored),
        _opt_int(None if group_idx is _MISSING else group_idx, "group_idx", ignored),
    )


# Array slots (tag = slot 0).
_STORED_SLOTS: Final = {
    "block_hashes": 1,
    "parent_block_hash": 2,
    "token_ids": 3,
    "block_size": 4,
    "lora_id": 5,
    "medium": 6,
    "lora_name": 7,
    "group_idx": 9,
    "kv_cache_spec_kind": 10,
}
_REMOVED_SLOTS: Final = {"block_hashes": 1, "medium": 2, "group_idx": 3}
_STORED_REQUIRED: Final = ("block_hashes", "token_ids", "block_size")


def _array_getter(ev: list[Any], slots: dict[str, int]) -> Any:
    n = len(ev)

    def get(name: str) -> Any:
        i = slots[name]
        return ev[i] if i < n else _MISSING

    return get


def _map_getter(ev: dict[Any, Any]) -> Any:
    def get(name: str) -> Any:
        return ev.get(name, _MISSING)

    return get


def _event(ev: Any, ignored: list[str]) -> Event | None:
    """One event, or ``None`` for an unknown tag (skipped)."""
    if type(ev) is dict:
        tag = ev.get("type")
        if type(tag) is not str:
            raise BatchRejected("event", "map event without a string 'type'")
        if tag == STORED:
            for name in _STORED_REQUIRED:
                if name not in ev:
                    raise BatchRejected("event", f"BlockStored map without {name!r}")
            return _stored(_map_getter(ev), ignored)
        if tag == REMOVED:
            if "block_hashes" not in ev:
                raise BatchRejected("event", "BlockRemoved map without 'block_hashes'")
            return _removed(_map_getter(ev), ignored)
        if tag == CLEARED:
            return AllBlocksCleared()
        return None
    if type(ev) is list and ev:
        tag = ev[0]
        if type(tag) is not str:
            raise BatchRejected("event", f"array event tag of type {type(tag).__name__}")
        if tag == STORED:
            if len(ev) < 5:
                raise BatchRejected("event", f"BlockStored array of {len(ev)} slots (need 5)")
            return _stored(_array_getter(ev, _STORED_SLOTS), ignored)
        if tag == REMOVED:
            if len(ev) < 2:
                raise BatchRejected("event", "BlockRemoved array without block_hashes")
            return _removed(_array_getter(ev, _REMOVED_SLOTS), ignored)
        if tag == CLEARED:
            return AllBlocksCleared()
        return None
    raise BatchRejected("event", f"event of type {type(ev).__name__} is not a tagged map or array")


def decode_untyped(payload: bytes) -> DecodedBatch:
    """Reference decoder: accepts every supported shape; raises :class:`BatchRejected`."""
    try:
        obj = _UNTYPED.decode(payload)
    except msgspec.DecodeError as e:
        raise BatchRejected("msgpack", str(e)) from None
    except RecursionError:  # msgspec recurses per nesting level; no engine nests this deep
        raise BatchRejected("msgpack", "nested too deeply") from None
    if type(obj) is list:
        if len(obj) < 2:
            raise BatchRejected("envelope", f"envelope array of {len(obj)} slots (need 2)")
        ts, events = obj[0], obj[1]
    elif type(obj) is dict:
        if "ts" not in obj or "events" not in obj:
            raise BatchRejected("envelope", "envelope map without 'ts' and 'events'")
        ts, events = obj["ts"], obj["events"]
    else:
        raise BatchRejected("envelope", f"envelope of type {type(obj).__name__}")
    if type(ts) is not int and type(ts) is not float:
        raise BatchRejected("envelope", f"ts of type {type(ts).__name__}")
    if type(events) is not list:
        raise BatchRejected("envelope", f"events of type {type(events).__name__}")
    ignored: list[str] = []
    out: list[Event] = []
    unknown = 0
    for ev in events:
        decoded = _event(ev, ignored)
        if decoded is None:
            unknown += 1
        else:
            out.append(decoded)
    return DecodedBatch(float(ts), out, unknown, ignored)


# ---------------------------------------------------------------------------------------------
# Fast path: msgspec typed decoders for the two common shapes (all-map or all-array events with
# int hashes and plain int tokens). Token ids and hashes stay raw msgpack (``msgspec.Raw``) and
# are converted in C by ``packed`` (``TokenIds``, an ``array('I')``: no Python int per token).
# Anything they reject goes to the reference decoder, which is authoritative for rejections and
# for the rarer shapes.
#
# The reference decodes every byte of the payload, so it rejects invalid UTF-8, a malformed
# timestamp ext or too deep a nesting anywhere, also inside fields nobody reads. msgspec's typed
# decoding skips unknown fields and keeps ``Raw`` ones without looking inside. To agree on every
# input, the typed structs forbid unknown fields (an unknown one hands the batch to the
# reference) and declare the fields engines send but we do not read as ``Raw``, which
# :func:`_check_skipped` decodes untyped before the batch is accepted.

_I64 = Annotated[int, msgspec.Meta(le=I64_MAX)]
_NO_RAW: Final = msgspec.Raw()  # an absent field (immutable: one shared default)


class _StoredMap(
    msgspec.Struct, tag_field="type", tag=STORED, forbid_unknown_fields=True, gc=False
):
    block_hashes: msgspec.Raw  # list[int] | None, converted by packed.hash_keys
    token_ids: msgspec.Raw  # list[u32] | None, converted by packed.token_array
    block_size: int
    parent_block_hash: int | None = None
    lora_id: _I64 | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    # sent by vLLM or SGLang (engine-events-and-subscriber.md §2.4, §2.5), not read here:
    # checked by _check_skipped
    extra_keys: msgspec.Raw = _NO_RAW
    kv_cache_spec_sliding_window: msgspec.Raw = _NO_RAW
    locality: msgspec.Raw = _NO_RAW
    ownership: msgspec.Raw = _NO_RAW
    session_id: msgspec.Raw = _NO_RAW
    lookahead_token_ids: msgspec.Raw = _NO_RAW
    cache_salt: msgspec.Raw = _NO_RAW


class _RemovedMap(
    msgspec.Struct, tag_field="type", tag=REMOVED, forbid_unknown_fields=True, gc=False
):
    block_hashes: msgspec.Raw
    medium: str | None = None
    group_idx: int | None = None
    locality: msgspec.Raw = _NO_RAW  # checked, not read
    ownership: msgspec.Raw = _NO_RAW  # checked, not read


class _ClearedMap(
    msgspec.Struct, tag_field="type", tag=CLEARED, forbid_unknown_fields=True, gc=False
):
    pass


class _StoredArray(
    msgspec.Struct, tag=STORED, array_like=True, forbid_unknown_fields=True, gc=False
):
    block_hashes: msgspec.Raw
    parent_block_hash: int | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: _I64 | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = _NO_RAW  # checked, not read
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: msgspec.Raw = _NO_RAW  # checked


class _RemovedArray(
    msgspec.Struct, tag=REMOVED, array_like=True, forbid_unknown_fields=True, gc=False
):
    block_hashes: msgspec.Raw
    medium: str | None = None
    group_idx: int | None = None


class _ClearedArray(
    msgspec.Struct, tag=CLEARED, array_like=True, forbid_unknown_fields=True, gc=False
):
    pass


class _MapBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    ts: float
    events: list[_StoredMap | _RemovedMap | _ClearedMap]
    data_parallel_rank: msgspec.Raw = _NO_RAW  # checked, not read


class _ArrayBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    ts: float
    events: list[_StoredArray | _RemovedArray | _ClearedArray]
    data_parallel_rank: msgspec.Raw = _NO_RAW  # checked, not read


class _Untyped(Exception):
    """A token or hash array is not the plain shape, or a skipped field is not valid msgpack
    for the reference: the reference decoder decides."""


# The fields of each typed struct that are kept raw and never read. In map events they are the
# last fields, so one ``astuple`` slice gets them all.
_SKIPPED_MAP: Final = (
    "extra_keys", "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids", "cache_salt",
)
_TAIL: Final[dict[type, int]] = {
    _StoredMap: len(_StoredMap.__struct_fields__) - len(_SKIPPED_MAP),
    _RemovedMap: len(_RemovedMap.__struct_fields__) - 2,
}
assert _StoredMap.__struct_fields__[_TAIL[_StoredMap]:] == _SKIPPED_MAP
assert _RemovedMap.__struct_fields__[_TAIL[_RemovedMap]:] == ("locality", "ownership")

# Raw fields of map events. msgspec keeps the last of repeated keys and never looks inside the
# earlier values, while the reference decodes them all. A repeated field is therefore always
# present in the typed event, and a payload whose bytes name a present raw field more often
# than the typed events hold it goes to the reference (a mention inside other data only costs
# the fast path). "token_ids" is also counted inside "lookahead_token_ids".
_TAIL_KEYS: Final[dict[type, tuple[bytes, ...]]] = {
    _StoredMap: tuple(n.encode() for n in _SKIPPED_MAP),
    _RemovedMap: (b"locality", b"ownership"),
}
_LOOKAHEAD: Final = b"lookahead_token_ids"


_MAX_CHECKED: Final = 512
"""Longest skipped field checked here; a longer one goes to the reference. A value can nest no
deeper than its length, so one checked here is never near the decoder's recursion limit, where
two decoders called from different stack depths could disagree."""


def _check_raw(raw: msgspec.Raw) -> None:
    """Decode a field we do not read the way the reference does (``_Untyped`` if that fails).
    A value of at most one byte is always valid: msgspec keeps only whole values as ``Raw``,
    and every one-byte msgpack value decodes."""
    if len(raw) > 1:
        if len(raw) > _MAX_CHECKED:
            raise _Untyped
        try:
            _UNTYPED.decode(raw)
        except Exception:  # invalid UTF-8, ext, nesting: the reference decides
            raise _Untyped from None


def _collect(tail: tuple[Any, ...], keys: tuple[bytes, ...], held: dict[bytes, int],
             raws: list[msgspec.Raw]) -> None:
    """Add the present skipped fields of one map event to ``raws`` (checked together by
    :func:`_check_raws`) and count them by key in ``held`` (for :func:`_check_repeats`)."""
    for raw, key in zip(tail, keys, strict=True):
        if raw is not _NO_RAW:
            if len(raw) > _MAX_CHECKED:
                raise _Untyped
            raws.append(raw)
            held[key] = held.get(key, 0) + 1


def _check_raws(raws: list[msgspec.Raw]) -> None:
    """:func:`_check_raw` for many values at once: one untyped decode of them as one array."""
    try:  # each is at most _MAX_CHECKED long (see _collect)
        _UNTYPED.decode(b"\xdd" + len(raws).to_bytes(4, "big") + b"".join(raws))
    except Exception:
        raise _Untyped from None


def _check_repeats(payload: bytes, stored: int, removed: int, held: dict[bytes, int]) -> None:
    count = payload.count
    if count(b"block_hashes") != stored + removed:
        raise _Untyped
    if count(b"token_ids") != stored + held.get(_LOOKAHEAD, 0):
        raise _Untyped
    for key, n in held.items():
        if count(key) != n:
            raise _Untyped


_STORED_TAIL: Final = _TAIL[_StoredMap]
_STORED_KEYS: Final = _TAIL_KEYS[_StoredMap]
_REMOVED_TAIL: Final = _TAIL[_RemovedMap]
_REMOVED_KEYS: Final = _TAIL_KEYS[_RemovedMap]


def _hashes(raw: msgspec.Raw) -> list[bytes]:
    keys = hash_keys(raw)
    if keys is None:
        raise _Untyped
    return keys


def _from_typed(batch: _MapBatch | _ArrayBatch, payload: bytes) -> DecodedBatch:
    if batch.data_parallel_rank is not _NO_RAW:
        _check_raw(batch.data_parallel_rank)
    maps = isinstance(batch, _MapBatch)
    held: dict[bytes, int] = {}  # map events: skipped raw fields present, for _check_repeats
    raws: list[msgspec.Raw] = []  # map events: the skipped raw fields present, for _check_raws
    stored = removed = 0
    out: list[Event] = []
    for ev in batch.events:
        if isinstance(ev, _StoredMap | _StoredArray):
            # the reference's order: hashes, tokens, then the block-size rule (so a raw field
            # that is not the plain shape always reaches the reference before a rejection here)
            hashes = _hashes(ev.block_hashes)
            tokens = token_array(ev.token_ids)
            if tokens is None:
                raise _Untyped
            if maps:
                stored += 1
                tail = astuple(ev)[_STORED_TAIL:]
                if tail.count(_NO_RAW) != len(tail):
                    _collect(tail, _STORED_KEYS, held, raws)
            else:
                _check_raw(ev.extra_keys)  # type: ignore[union-attr]
                _check_raw(ev.kv_cache_spec_sliding_window)  # type: ignore[union-attr]
            _check_block_size(ev.block_size, bool(tokens), ev.medium)
            parent = ev.parent_block_hash
            out.append(
                BlockStored(
                    hashes,
                    None if parent is None else normalize_hash(parent),
                    tokens,
                    ev.block_size,
                    ev.lora_id,
                    ev.medium,
                    ev.lora_name,
                    ev.group_idx,
                    ev.kv_cache_spec_kind,
                )
            )
        elif isinstance(ev, _RemovedMap | _RemovedArray):
            hashes = _hashes(ev.block_hashes)
            if maps:
                removed += 1
                tail = astuple(ev)[_REMOVED_TAIL:]
                if tail.count(_NO_RAW) != len(tail):
                    _collect(tail, _REMOVED_KEYS, held, raws)
            out.append(BlockRemoved(hashes, ev.medium, ev.group_idx))
        else:
            out.append(AllBlocksCleared())
    if maps:
        if raws:
            _check_raws(raws)
        _check_repeats(payload, stored, removed, held)
    return DecodedBatch(batch.ts, out)


_MAP_DECODER: Final = msgspec.msgpack.Decoder(_MapBatch)
_ARRAY_DECODER: Final = msgspec.msgpack.Decoder(_ArrayBatch)


class BatchDecoder:
    """Decode payloads, trying the typed decoder that last succeeded first.

    A fleet mid-upgrade mixes shapes; the adaptive order keeps the common case to one attempt.
    """

    def __init__(self) -> None:
        self._decoders: list[msgspec.msgpack.Decoder[Any]] = [_MAP_DECODER, _ARRAY_DECODER]

    def decode(self, payload: bytes) -> DecodedBatch:
        """Decode one payload; raises :class:`BatchRejected` for an invalid batch."""
        decoders = self._decoders
        for i, dec in enumerate(decoders):
            try:
                typed = dec.decode(payload)
            except msgspec.ValidationError:
                continue
            except (msgspec.DecodeError, RecursionError):
                break  # not msgpack at all, or nested too deeply: let the reference report it
            if i:
                decoders.insert(0, decoders.pop(i))
            try:
                return _from_typed(typed, payload)
            except (_Untyped, BatchRejected):  # the reference decides every rejection
                break
        return decode_untyped(payload)


_DEFAULT = BatchDecoder()


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one ``EventBatch`` payload (module-level convenience over :class:`BatchDecoder`)."""
    return _DEFAULT.decode(payload)
