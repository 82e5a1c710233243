"""Type stub of the compiled twin of ``ingestwire.pure`` (``_native.c``)."""

from collections.abc import Sequence

from inferencecache.ingestwire.pure import Parsed

def parse_update(buf: bytes, /) -> Parsed | None: ...
def encode_entries(entries: Sequence[tuple[bytes, int, str, int]], /) -> bytes: ...
