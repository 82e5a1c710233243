"""Pure-Python twin of ``ingestwire._native``: identical results, slower (the reference).

See ``ingestwire/__init__.py`` for what each function does and why it exists.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferencecache.varint import put as _put_varint

# (hashes: 8-byte prefix hashes concatenated, token counts, wire tier, entry adapter_id)
LegacyItem = tuple[bytes, list[int], int, str]
# (prefix_hash, token_count, block_hashes, block_token_counts, wire tier, adapter_id)
GenericItem = tuple[bytes, int, list[bytes], list[int], int, str]
# (replica_id, model_id, tenant_id, hash_scheme, timestamp_us, adapter_id, entries)
Parsed = tuple[str, str, str, str, int, str, list[LegacyItem | GenericItem]]

_U64 = (1 << 64) - 1


class _Decline(Exception):
    """The compact parser declines this message; protobuf decides."""


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """One varint (≤ 10 bytes; a 10th byte above 1 declines: protobuf decides)."""
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise _Decline
        b = buf[pos]
        pos += 1
        if shift == 63 and b > 1:
            raise _Decline
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & _U64, pos
        shift += 7
        if shift > 63:
            raise _Decline


def _i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 0x1_0000_0000 if v >= 0x8000_0000 else v


def _i64(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def _delimited(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(start, stop) of a length-delimited payload at ``pos``."""
    length, pos = _varint(buf, pos, end)
    stop = pos + length
    if stop > end:
        raise _Decline
    return pos, stop


def _text(buf: bytes, start: int, stop: int) -> str:
    try:
        return buf[start:stop].decode()  # strict UTF-8, as protobuf checks proto3 strings
    except UnicodeDecodeError:
        raise _Decline from None


def _skip(buf: bytes, pos: int, end: int, wire: int) -> int:
    """Skip an unknown field's value (groups and invalid wire types decline)."""
    if wire == 0:
        return _varint(buf, pos, end)[1]
    if wire == 2:
        return _delimited(buf, pos, end)[1]
    if wire == 1 or wire == 5:
        pos += 8 if wire == 1 else 4
        if pos > end:
            raise _Decline
        return pos
    raise _Decline


def _entry(buf: bytes, pos: int, end: int) -> GenericItem:
    """One PrefixEntry (field values; repeated scalars last-wins, as protobuf merges)."""
    ph = b""
    tc = 0
    hashes: list[bytes] = []
    counts: list[int] = []
    tier = 0
    adapter = ""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field = key >> 3
        wire = key & 7
        if field == 0 or key > 0xFFFFFFFF:
            raise _Decline  # invalid tag
        if field > 6:
            pos = _skip(buf, pos, end, wire)
        elif wire == 2:
            start, pos = _delimited(buf, pos, end)
            if field == 1:
                ph = buf[start:pos]
            elif field == 3:
                hashes.append(buf[start:pos])
            elif field == 4:  # packed repeated int32
                while start < pos:
                    v, start = _varint(buf, start, pos)
                    counts.append(_i32(v))
            elif field == 6:
                adapter = _text(buf, start, pos)
            else:
                raise _Decline  # a wire-type mismatch on a known field
        elif wire == 0:
            v, pos = _varint(buf, pos, end)
            if field == 2:
                tc = _i32(v)
            elif field == 4:  # unpacked repeated int32
                counts.append(_i32(v))
            elif field == 5:
                tier = _i32(v)
            else:
                raise _Decline
        else:
            raise _Decline
    if pos != end:
        raise _Decline
    return ph, tc, hashes, counts, tier, adapter


def _parse(buf: bytes) -> Parsed:
    n = len(buf)
    pos = 0
    replica = model = tenant = scheme = adapter = ""
    ts = 0
    items: list[LegacyItem | GenericItem] = []
    run_hashes: bytearray | None = None
    run_counts: list[int] = []
    run_tier = 0
    run_adapter = ""

    def close_run() -> None:
        nonlocal run_hashes, run_counts
        if run_hashes is not None:
            items.append((bytes(run_hashes), run_counts, run_tier, run_adapter))
            run_hashes = None
            run_counts = []

    while pos < n:
        if buf[pos] == 0x32 and pos + 13 < n and buf[pos + 1] < 0x80 and buf[pos + 2] == 0x0A:
            # the common legacy entry: 0a 08 <hash> [10 <count>] [28 <tier>], adapter empty
            stop = pos + 2 + buf[pos + 1]
            if buf[pos + 3] == 8 and stop <= n:
                p = pos + 12
                tc = tier = 0
                if p < stop and buf[p] == 0x10:
                    v, p = _varint(buf, p + 1, stop)
                    tc = _i32(v)
                if p < stop and buf[p] == 0x28:
                    v, p = _varint(buf, p + 1, stop)
                    tier = _i32(v)
                if p == stop:
                    if run_hashes is None or tier != run_tier or run_adapter:
                        close_run()
                        run_hashes = bytearray()
                        run_tier = tier
                        run_adapter = ""
                    run_hashes += buf[pos + 4 : pos + 12]
                    run_counts.append(tc)
                    pos = stop
                    continue
        key, pos = _varint(buf, pos, n)
        field = key >> 3
        wire = key & 7
        if field == 0 or field == 7 or key > 0xFFFFFFFF:
            raise _Decline  # an invalid tag; stats (rare: protobuf does them)
        if field > 8:
            pos = _skip(buf, pos, n, wire)
        elif field == 5:
            if wire != 0:
                raise _Decline
            v, pos = _varint(buf, pos, n)
            ts = _i64(v)
        elif wire != 2:
            raise _Decline
        else:
            start, pos = _delimited(buf, pos, n)
            if field == 6:
                ph, tc, hashes, counts, tier, ad = _entry(buf, start, pos)
                if not hashes and not counts and len(ph) == 8:
                    if run_hashes is None or tier != run_tier or ad != run_adapter:
                        close_run()
                        run_hashes = bytearray()
                        run_tier = tier
                        run_adapter = ad
                    run_hashes += ph
                    run_counts.append(tc)
                else:
                    close_run()
                    items.append((ph, tc, hashes, counts, tier, ad))
            elif field == 1:
                replica = _text(buf, start, pos)
            elif field == 2:
                model = _text(buf, start, pos)
            elif field == 3:
                tenant = _text(buf, start, pos)
            elif field == 4:
                scheme = _text(buf, start, pos)
            else:  # 8
                adapter = _text(buf, start, pos)
    close_run()
    return replica, model, tenant, scheme, ts, adapter, items


def parse_update(buf: bytes, /) -> Parsed | None:
    """A ``CacheStateUpdate`` in compact form, or None when protobuf should decide."""
    try:
        return _parse(bytes(buf))
    except _Decline:
        return None


def encode_entries(entries: Sequence[tuple[bytes, int, str, int]], /) -> bytes:
    """``(prefix_hash, token_count, adapter_id, tier)`` tuples → the ``prefixes`` field (6) of a
    ``CacheStateUpdate``, byte for byte what protobuf writes for legacy entries."""
    out = bytearray()
    body = bytearray()
    for entry in entries:
        prefix, tokens, adapter, tier = entry
        if not isinstance(prefix, bytes) or not isinstance(adapter, str):
            raise TypeError("an entry is (bytes, int, str, int)")
        if not -(1 << 31) <= tokens < (1 << 31) or not -(1 << 31) <= tier < (1 << 31):
            raise OverflowError("token_count and tier are int32")
        body.clear()
        if prefix:
            body.append(0x0A)
            _put_varint(body, len(prefix))
            body += prefix
        if tokens:
            body.append(0x10)
            _put_varint(body, tokens)
        if tier:
            body.append(0x28)
            _put_varint(body, tier)
        if adapter:
            raw = adapter.encode()
            body.append(0x32)
            _put_varint(body, len(raw))
            body += raw
        out.append(0x32)
        _put_varint(out, len(body))
        out += body
    return bytes(out)
