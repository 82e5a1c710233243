"""inferencecache: KV-cache-aware routing hints for LLM inference fleets."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("inferencecache")
except _metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
