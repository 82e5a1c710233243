"""Type stub of the compiled CacheStateUpdate codec (``_native.c``); without it, protobuf."""

from collections.abc import Sequence

from inferencecache.updatewire import Entry, Parsed

def parse_update(buf: bytes, /) -> Parsed | None: ...
def encode_entries(entries: Sequence[Entry], /) -> bytes: ...
