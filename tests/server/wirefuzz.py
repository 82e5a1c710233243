"""Inputs for the LookupRoute wire parser's differential tests (valid requests of every shape,
and the same bytes damaged: flipped, cut, inserted, deleted), and protobuf's reading of them."""

from __future__ import annotations

import random

from hypothesis import strategies as st

from inferencecache.fingerprint import decode_varints, split_packed
from inferencecache.index.model import LookupRequest
from inferencecache.server import lookup_wire
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)


@st.composite
def requests(draw: st.DrawFn) -> pb.LookupRouteRequest:
    req = pb.LookupRouteRequest(
        model_id=draw(st.text(max_size=20)),
        tenant_id=draw(st.text(max_size=20)),
        hash_scheme=draw(st.sampled_from(["", "vllm", "sglang", draw(st.text(max_size=5))])),
        prefix_hash=draw(st.binary(max_size=16)),
        prefix_token_count=draw(INT32),
        prompt_text=draw(st.text(max_size=30)),
        adapter_id=draw(st.text(max_size=10)),
    )
    hash_len = draw(st.sampled_from([8, 8, 8, None]))
    n = draw(st.integers(0, 40))
    if hash_len is None:
        req.block_hashes.extend(draw(st.lists(st.binary(max_size=12), max_size=n)))
    else:
        req.block_hashes.extend(draw(st.lists(st.binary(min_size=8, max_size=8), max_size=n)))
    counts = draw(st.sampled_from(["small", "any", "none"]))
    if counts == "small":
        req.block_token_counts.extend(draw(st.lists(st.integers(0, 127), max_size=n)))
    elif counts == "any":
        req.block_token_counts.extend(draw(st.lists(INT32, max_size=n)))
    req.token_ids.extend(draw(st.lists(st.one_of(st.integers(0, 300_000), UINT32), max_size=80)))
    if draw(st.booleans()):
        req.slo.ttft_ms = draw(INT32)
        req.slo.tbt_ms = draw(INT32)
    return req


def mutate(buf: bytes, rnd: random.Random) -> bytes:
    """``buf`` with one to four random flips, truncations, insertions or deletions."""
    out = bytearray(buf)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.choice(["flip", "truncate", "insert", "delete"])
        if op == "flip" and out:
            out[rnd.randrange(len(out))] = rnd.randrange(256)
        elif op == "truncate" and out:
            del out[rnd.randrange(len(out)) :]
        elif op == "insert":
            pos = rnd.randrange(len(out) + 1)
            out[pos:pos] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 6)))
        elif op == "delete" and out:
            pos = rnd.randrange(len(out))
            del out[pos : pos + rnd.randint(1, 3)]
    return bytes(out)


class AboveU32:
    """Token payload holding a varint above 2**32-1 (decoded by the index, as protobuf does)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, list)


def norm(r: LookupRequest | object) -> tuple[object, ...]:
    """A request's meaning, whichever packed or unpacked form the parser chose."""
    assert isinstance(r, LookupRequest)
    if r.packed_hashes:
        assert isinstance(r.block_hashes, bytes)
        hashes = split_packed(r.block_hashes)
    else:
        assert not isinstance(r.block_hashes, bytes)
        hashes = list(r.block_hashes)
    tokens: object
    if r.token_varints:
        assert isinstance(r.token_ids, bytes)
        try:
            tokens = list(decode_varints(r.token_ids))
        except ValueError:
            tokens = AboveU32()
    else:
        tokens = list(r.token_ids)
    return (
        r.tenant_id,
        r.model_id,
        r.hash_scheme,
        r.adapter_id,
        r.prefix_hash,
        r.prefix_token_count,
        hashes,
        list(r.block_token_counts),
        tokens,
        r.prompt_text,
        r.ttft_ms,
    )


def reference(buf: bytes) -> tuple[object, ...] | None:
    """What protobuf makes of ``buf`` (None: not decodable)."""
    try:
        msg = pb.LookupRouteRequest.FromString(buf)
    except Exception:
        return None
    return norm(lookup_wire.from_message(msg))
