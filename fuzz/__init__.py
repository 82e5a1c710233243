"""Fuzz harnesses for every entry point that takes outside bytes (docs/security.md).

Each harness module has ``check(data: bytes) -> None`` (raises on a finding: a crash, an
unexpected exception, or a difference from the reference implementation) and ``seeds()`` (a
starting corpus). ``python -m fuzz.run NAME [libFuzzer flags]`` runs one under atheris;
``scripts/fuzz`` builds the C extensions with ASan+UBSan and runs them.
"""

HARNESSES = (
    "engine_frames",
    "fingerprint_chain",
    "blockmap_ops",
    "lookup_request",
    "cache_state_update",
)
