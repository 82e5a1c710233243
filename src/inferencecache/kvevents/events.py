"""The decoded, validated KV-event model (one shape for every engine release).

The decoder (:mod:`.decode`) produces these from any supported wire shape, so the subscriber
never looks at arrays, maps or version differences. Hashes are already normalised
(:func:`.hashes.normalize_hash`); optional fields that were absent, nil, or of the wrong type are
``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

GPU: Final = "GPU"
"""The engine's own KV cache medium (``medium`` nil or ``GPU`` in any case)."""


def normalize_medium(medium: str | None) -> str:
    """``None``/``GPU`` in any letter case → ``"GPU"``; every other string unchanged."""
    if medium is None or medium == GPU or medium.upper() == GPU:
        return GPU
    return medium


class BlockStored(msgspec.Struct, gc=False):
    """Newly cached full blocks of one request (or a connector's copy of them)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    # packed.TokenIds (an array('I') equal to the list of its ints) from the decoder; any
    # sequence of ints works
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    # SGLang EAGLE bigram keys: token_ids held [a, b] pairs (token_ids is then empty).
    bigram: bool = False


class BlockRemoved(msgspec.Struct, gc=False):
    """Blocks dropped from one medium."""

    block_hashes: list[bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, gc=False):
    """The engine reset its prefix cache."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class DecodedBatch(msgspec.Struct, gc=False):
    """One accepted ``EventBatch``: every event valid, unknown event types already skipped."""

    ts: float
    events: list[Event]
    # Number of events with an unknown tag that were skipped (kept the rest of the batch).
    unknown_events: int = 0
    # Names of optional fields present with a wrong type, read as absent (one entry per field).
    ignored_fields: list[str] = msgspec.field(default_factory=list)
