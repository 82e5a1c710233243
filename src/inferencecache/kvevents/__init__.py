"""The engines' KV-event wire vocabulary, shared by the subscriber (decodes) and the fake engines
(encode), owned by neither.

* :mod:`.events` - the decoded, validated event model the subscriber consumes;
* :mod:`.decode` - a tolerant decoder for every vLLM / SGLang release line
  (engine-events-and-subscriber.md §2, §3.3);
* :mod:`.encode` - writers of the exact wire shape of a chosen release (fake engines, tests);
* :mod:`.hashes` - engine block-hash normalisation (the reverse-map key);
* :mod:`.framing` - ZeroMQ 3-frame messages and the two replay request/reply generations.
"""

from inferencecache.kvevents.decode import BatchDecoder, BatchRejected, decode_batch
from inferencecache.kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    Event,
)
from inferencecache.kvevents.hashes import normalize_hash

__all__ = [
    "AllBlocksCleared",
    "BatchDecoder",
    "BatchRejected",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "Event",
    "decode_batch",
    "normalize_hash",
]
