"""Every compiled wire decoder against protobuf, the reference, on the encodings that trip
hand-written parsers: tags and lengths in 1 to 6 bytes, value varints padded to 10 and 11 bytes,
truncation at every byte, unknown fields of every wire type (groups and invalid ones included),
known fields under another wire type, all of it inside nested messages too.

The rule (include/ic_wire.h): a compiled parser answers only for messages protobuf decodes, and
then means exactly what protobuf reads; for anything else it returns None and protobuf decides.
Both decoders are checked: LookupRouteRequest (``server._lookupwire``) and CacheStateUpdate
(``updatewire._native``, the ReportCacheState request).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache import accelerators
from inferencecache.index.model import LegacyRun
from inferencecache.server.report_request import packed_from_parsed
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

from .test_lookupwire import agree as lookup_agrees
from .test_report_request import updates
from .wirefuzz import requests

LW = accelerators.built("inferencecache.server._lookupwire")
UW = accelerators.built("inferencecache.updatewire._native")
pytestmark = pytest.mark.skipif(LW is None or UW is None, reason="C accelerators not built")

# Nested message fields: (message, field number) -> the nested message type.
NESTED = {("lookup", 6): "slo", ("update", 6): "entry", ("update", 7): "stats"}


# ---- the wire, token by token --------------------------------------------------------------


def varint(v: int, size: int = 0) -> bytes:
    """``v``'s varint, padded with continuation bytes to ``size`` bytes (non-canonical)."""
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v == 0 and len(out) + 1 >= size:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7


Field = tuple[int, int, Any]
"""(field number, wire type, value): an int for varints, bytes for fixed and length-delimited
values, a list of fields for a nested message."""


def tokens(buf: bytes, kind: str) -> list[Field]:
    """The top-level fields of a valid message (nested messages split too)."""
    out: list[Field] = []
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, pos = read_varint(buf, pos)
            out.append((field, wire, v))
        elif wire in (1, 5):
            w = 8 if wire == 1 else 4
            out.append((field, wire, buf[pos : pos + w]))
            pos += w
        else:
            n, pos = read_varint(buf, pos)
            payload = buf[pos : pos + n]
            pos += n
            sub = NESTED.get((kind, field))
            out.append((field, wire, tokens(payload, sub) if sub else payload))
    return out


def emit(fields: list[Field], tag_size: int = 0, len_size: int = 0, int_size: int = 0) -> bytes:
    """The fields back to bytes, every tag, length and varint value padded as asked."""
    out = bytearray()
    for field, wire, value in fields:
        out += varint(field << 3 | wire, tag_size)
        if wire == 0:
            out += varint(value, int_size)
        elif wire in (1, 5):
            out += value
        else:
            if isinstance(value, list):
                value = emit(value, tag_size, len_size, int_size)
            out += varint(len(value), len_size) + value
    return bytes(out)


# ---- both decoders against protobuf ----------------------------------------------------------


def update_meaning(msg: pb.CacheStateUpdate) -> tuple[Any, ...]:
    stats = None
    if msg.HasField("stats"):
        s = msg.stats
        stats = (s.cache_memory_bytes, s.hit_rate, s.pressure, s.t2_hit_tokens, s.t2_query_tokens)
    entries = [(p.prefix_hash, p.token_count, list(p.block_hashes), list(p.block_token_counts),
                p.tier, p.adapter_id) for p in msg.prefixes]  # fmt: skip
    return (msg.replica_id, msg.model_id, msg.tenant_id, msg.hash_scheme, msg.timestamp_us,
            msg.adapter_id, entries, repr(stats))  # fmt: skip


def update_agrees(buf: bytes) -> bool:
    assert UW is not None
    parsed = UW.parse_update(buf)
    try:
        msg = pb.CacheStateUpdate.FromString(buf)
    except Exception:
        assert parsed is None, buf
        return False
    if parsed is None:
        return False
    packed = packed_from_parsed(parsed)
    entries: list[tuple[Any, ...]] = []
    for e in packed.entries:
        if isinstance(e, LegacyRun):
            entries += [(e.hashes[8 * i : 8 * i + 8], c, [], [], e.tier, e.adapter_id)
                        for i, c in enumerate(e.token_counts)]  # fmt: skip
        else:
            entries.append((e.prefix_hash, e.token_count, list(e.block_hashes),
                            list(e.block_token_counts), e.tier, e.adapter_id))  # fmt: skip
    got = (packed.replica_id, packed.model_id, packed.tenant_id, packed.hash_scheme,
           packed.timestamp_us, packed.adapter_id, entries, repr(parsed[7]))  # fmt: skip
    assert got == update_meaning(msg), buf
    return True


DECODERS: dict[str, Callable[[bytes], bool]] = {"lookup": lookup_agrees, "update": update_agrees}
"""kind -> agrees(buf): the compiled parser's reading equals protobuf's (never answering what
protobuf rejects); returns whether it answered."""


def samples() -> st.SearchStrategy[tuple[str, bytes]]:
    lookups = requests().map(lambda m: ("lookup", m.SerializeToString()))
    ups = updates().map(lambda m: ("update", m.SerializeToString()))
    return st.one_of(lookups, ups)


def _stats_filled(kind: str, buf: bytes) -> bytes:
    """Give an update stats sometimes (the generator rarely does)."""
    if kind != "update":
        return buf
    u = pb.CacheStateUpdate.FromString(buf)
    u.stats.hit_rate = 0.25
    u.stats.t2_hit_tokens = -3
    u.stats.replica_id = "r"
    return bytes(u.SerializeToString())


# ---- the targeted encodings -------------------------------------------------------------------


# what is padded -> (the sizes tried, the largest protobuf accepts)
PADDED = {"tag_size": ((1, 2, 5, 6), 5), "len_size": ((1, 2, 5, 6), 5),
          "int_size": ((2, 5, 9, 10, 11), 10)}  # fmt: skip


@pytest.mark.parametrize("what", sorted(PADDED))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample=samples(), pick=st.integers(0, 4))
def test_tags_lengths_and_varints_padded(what: str, sample: tuple[str, bytes], pick: int) -> None:
    """Every tag, length or value varint re-encoded non-canonically in ``size`` bytes: protobuf
    reads tags and lengths of up to 5 bytes and values of up to 10, and rejects longer ones; so
    must the parsers, and they must answer every shorter form."""
    sizes, limit = PADDED[what]
    size = sizes[pick % len(sizes)]
    kind, buf = sample
    answered = DECODERS[kind](emit(tokens(_stats_filled(kind, buf), kind), **{what: size}))
    if size <= limit:
        assert answered


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples())
def test_truncated_at_every_byte(sample: tuple[str, bytes]) -> None:
    kind, buf = sample
    agree = DECODERS[kind]
    for cut in range(len(buf)):
        agree(buf[:cut])


UNKNOWN = [
    b"\x60\x05",  # field 12, varint
    b"\x6a\x03\xff\xfe\x00",  # field 13, bytes (invalid UTF-8 is fine in an unknown field)
    b"\x71" + b"\x01" * 8,  # field 14, fixed64
    b"\x7d" + b"\x01" * 4,  # field 15, fixed32
    b"\xa0\x06" + b"\xff" * 9 + b"\x7f",  # field 100, a 10-byte varint
    b"\xfa\xff\xff\xff\x0f\x00",  # field 2**29-1, the largest
    b"\x63\x64",  # field 12, an empty group
    b"\x63\x68\x01\x64",  # field 12, a group holding a varint
    b"\x63",  # an unterminated group
    b"\x64",  # an end-group tag alone
    b"\x66",  # wire type 6
    b"\x67",  # wire type 7
    b"\x02\x00",  # field 0
    b"\xfa\xff\xff\xff\x1f\x00",  # a tag above 32 bits
    b"\x71\x01",  # fixed64 cut short
    b"\x6a\x05ab",  # a length past the end
]


@pytest.mark.parametrize("extra", UNKNOWN)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample=samples(), where=st.floats(0, 1), nested=st.booleans())
def test_unknown_and_invalid_fields(
    extra: bytes, sample: tuple[str, bytes], where: float, nested: bool
) -> None:
    """Inserted between top-level fields or inside a nested message (SLO, PrefixEntry, stats)."""
    kind, buf = sample
    buf = _stats_filled(kind, buf)
    fields = tokens(buf, kind)
    subs = [i for i, f in enumerate(fields) if isinstance(f[2], list)]
    if nested and subs:
        i = subs[int(where * len(subs)) % len(subs)]
        field, wire, value = fields[i]
        at = int(where * (len(value) + 1)) % (len(value) + 1)
        inner = emit(value[:at]) + extra + emit(value[at:])
        fields[i] = (field, wire, inner)
        data = emit(fields)
    else:
        at = int(where * (len(fields) + 1)) % (len(fields) + 1)
        data = emit(fields[:at]) + extra + emit(fields[at:])
    DECODERS[kind](data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample=samples(), pick=st.integers(0, 10**6), wire=st.sampled_from([0, 1, 2, 5]),
       rnd=st.randoms(use_true_random=False))
def test_known_fields_under_another_wire_type(
    sample: tuple[str, bytes], pick: int, wire: int, rnd: random.Random
) -> None:
    """Protobuf keeps such a field as an unknown field: the value is skipped, not read."""
    kind, buf = sample
    buf = _stats_filled(kind, buf)
    fields = tokens(buf, kind)
    number = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11][pick % 11] if kind == "lookup" else pick % 8 + 1
    value: Any = {0: rnd.randrange(2**64), 1: rnd.randbytes(8), 5: rnd.randbytes(4),
                  2: rnd.randbytes(rnd.randrange(12))}[wire]  # fmt: skip
    at = pick % (len(fields) + 1)
    data = emit([*fields[:at], (number, wire, value), *fields[at:]])
    DECODERS[kind](data)


def test_the_reported_cases() -> None:
    """Issue 15: tags and lengths in more than 5 bytes were applied / answered."""
    for kind, buf in (
        ("lookup", b"\x8a\x80\x80\x80\x80\x00\x01m"),
        ("lookup", b"\x0a\x81\x80\x80\x80\x80\x00m"),
        ("update", b"\x8a\x80\x80\x80\x80\x00\x01r"),
        ("update", b"\x0a\x81\x80\x80\x80\x80\x00r"),
        ("update", b"\x32\x0f\x8a\x80\x80\x80\x80\x00\x08" + b"h" * 8),
    ):
        assert not DECODERS[kind](buf)
