"""Run one harness under atheris: ``python -m fuzz.run NAME [libFuzzer flags]``.

The package's own modules are imported under atheris's Python coverage instrumentation; the C
extensions carry libFuzzer's (``-fsanitize=fuzzer-no-link``, see ``scripts/fuzz``).
``INFERENCECACHE_FUZZ_PY_COVERAGE=0`` skips the Python instrumentation (more executions per
second for a long campaign; the C code keeps its coverage feedback).
"""

from __future__ import annotations

import importlib
import os
import sys

import atheris

from fuzz import HARNESSES


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in HARNESSES:
        sys.exit(f"usage: python -m fuzz.run {{{','.join(HARNESSES)}}} [libFuzzer flags]")
    name = sys.argv[1]
    if os.environ.get("INFERENCECACHE_FUZZ_PY_COVERAGE", "1") == "0":
        harness = importlib.import_module(f"fuzz.{name}")  # C coverage only: faster, blinder
    else:
        with atheris.instrument_imports(include=["inferencecache", "fuzz"]):
            harness = importlib.import_module(f"fuzz.{name}")
    atheris.Setup([sys.argv[0], *sys.argv[2:]], harness.check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
