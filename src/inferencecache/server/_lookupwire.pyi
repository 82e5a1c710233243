"""Type stub of the compiled LookupRoute wire helpers (``_lookupwire.c``); twins in ``wire.py``."""

from typing import Any, final

REQUEST_FIELDS: int

def parse(buf: bytes, /) -> tuple[Any, ...] | None:
    """The ``LookupRequest`` fields of a request in field order, or None (run ``parse_fast``)."""

@final
class Encoder:
    """``Encoder(LookupResult, ReplicaScore)``: both plain ``__slots__`` records."""

    def __init__(self, result_type: type, score_type: type) -> None: ...
    def encode(self, result: Any, /) -> bytes | None:
        """The LookupRouteResponse bytes protobuf produces, or None (build the message)."""
