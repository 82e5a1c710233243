"""Engine frames (the subscriber's ZeroMQ input): differential of the event decoders.

- the fast ``BatchDecoder`` (msgspec typed, in both typed-decoder orders) against the reference
  ``decode_untyped``: the same batch or the same rejection reason;
- the reference against msgspec's generic decoding: rejected with reason ``msgpack`` exactly
  when msgspec cannot decode the payload;
- ``kvevents._native`` token/hash array readers against their msgspec twins;
- the frame shape checks never raise anything but their own error.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any

import msgspec

from inferencecache import accelerators
from inferencecache.kvevents.decode import BatchDecoder, BatchRejected, decode_untyped
from inferencecache.kvevents.encode import WireRemoved, WireStored, encode_batch
from inferencecache.kvevents.framing import FrameError, parse_live, parse_replay_reply
from inferencecache.kvevents.packed import hash_keys_py, token_array_py

_CANON = msgspec.msgpack.Encoder(enc_hook=list)  # TokenIds (an array) as a list; NaN == NaN
_GENERIC = msgspec.msgpack.Decoder()
_NATIVE = accelerators.built("inferencecache.kvevents._native")
FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm_kv_events"


def _outcome(decode: Any, data: bytes) -> bytes | tuple[str, str]:
    try:
        batch = decode(data)
    except BatchRejected as e:
        return ("rejected", e.reason)
    return _CANON.encode(batch)


def check(data: bytes) -> None:
    ref = _outcome(decode_untyped, data)
    flipped = BatchDecoder()
    flipped._decoders.reverse()
    for dec in (BatchDecoder(), flipped):
        got = _outcome(dec.decode, data)
        assert got == ref, (got, ref)
    try:
        _GENERIC.decode(data)
        generic_ok = True
    except (msgspec.DecodeError, RecursionError):
        generic_ok = False
    assert (ref == ("rejected", "msgpack")) == (not generic_ok), (ref, generic_ok)
    if _NATIVE is not None:
        assert _NATIVE.token_array(data) == token_array_py(data)
        assert _NATIVE.hash_keys(data) == hash_keys_py(data)
    frames = data.split(b"\xf0\xf1", 4)
    with contextlib.suppress(FrameError):
        parse_live(frames)
    parse_replay_reply(frames)


def seeds() -> list[bytes]:
    out = [p.read_bytes() for p in sorted(FIXTURES.glob("*.bin"))]
    stored = WireStored([1, 2**64 - 1], None, list(range(32)), 16, medium="GPU")
    for fmt in ("vllm-0.9", "vllm-0.22", "vllm-0.33", "sglang-0.5.23"):
        try:
            out.append(encode_batch(1.5, [stored, WireRemoved([1])], fmt))
        except (KeyError, ValueError):
            continue
    out += [b"\x92\x00\x91" + b"\x91" * 40 + b"\xc0", b"\x93\xcb" + b"\x00" * 8 + b"\x90\x00"]
    return out
