"""Write each harness's seed inputs into a corpus directory (``scripts/fuzz`` calls this)."""

from __future__ import annotations

import hashlib
import importlib
import pathlib
import sys

from fuzz import HARNESSES


def write(name: str, directory: pathlib.Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    harness = importlib.import_module(f"fuzz.{name}")
    n = 0
    for seed in harness.seeds():
        path = directory / ("seed-" + hashlib.sha1(seed).hexdigest())
        if not path.exists():
            path.write_bytes(seed)
            n += 1
    return n


if __name__ == "__main__":
    root = pathlib.Path(sys.argv[1])
    for name in sys.argv[2:] or HARNESSES:
        write(name, root / name)
