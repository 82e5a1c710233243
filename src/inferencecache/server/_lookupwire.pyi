"""Type stub of the compiled LookupRoute wire helpers (``_lookupwire.c``); without the build,
protobuf parses and serializes (``lookup_wire.py``)."""

from typing import Any

from inferencecache.index.model import LookupResult

REQUEST_FIELDS: int

def parse(buf: bytes, /) -> tuple[Any, ...] | None:
    """The ``LookupRequest`` fields of a request in field order, or None (protobuf decides)."""

def encode(result: LookupResult, /) -> bytes | None:
    """The LookupRouteResponse bytes protobuf produces, or None (build the message)."""
