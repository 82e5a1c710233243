"""Engine block-hash normalisation (engine-events-and-subscriber.md §3.3): the key of the
subscriber's reverse map.

Engine hashes are opaque identities, never routing keys. vLLM ≤ 0.10.1 publishes Python
``hash()`` values (signed), later releases the low 64 bits of a digest (unsigned, often ≥ 2^63)
or, with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, the raw 32-byte digest; SGLang signed int64.
One key form for all of them: ints become 8-byte big-endian of ``value mod 2^64`` (so a negative
value keys as its two's complement), bin/str values are kept as bytes.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def normalize_hash(value: int | bytes | str) -> bytes:
    """Return the reverse-map key of one engine hash (int, bin or str)."""
    if type(value) is int:
        return (value & MASK64).to_bytes(8, "big")
    if type(value) is bytes:
        return value
    if type(value) is str:
        return value.encode("utf-8", "surrogatepass")
    raise TypeError(f"not an engine hash: {type(value).__name__}")
