"""Which implementation `inferencecache.fingerprint` picks, driven by the environment."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import NATIVE

PROBE = (
    "import sys\n"
    "if 'hide' in sys.argv: sys.modules['inferencecache.fingerprint._native'] = None\n"
    "try:\n"
    "    import inferencecache.fingerprint as f\n"
    "except ImportError as e:\n"
    "    print('ImportError', e)\n"
    "else:\n"
    "    print(f.IMPLEMENTATION, f.prefix_hashes(list(range(1, 17)), 16))\n"
)


def probe(env: dict[str, str], *args: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCECACHE_")}
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.strip()


GOLDEN = "[16863443419780771464]"


@pytest.mark.skipif(NATIVE is None, reason="C accelerator not built")
def test_native_is_the_default_when_built() -> None:
    assert probe({}) == f"native {GOLDEN}"


def test_pure_python_forced() -> None:
    assert probe({"INFERENCECACHE_PURE_PYTHON": "1"}) == f"python {GOLDEN}"
    assert probe({"INFERENCECACHE_PURE_PYTHON": "0"}).split()[0] == (
        "native" if NATIVE else "python"
    )


def test_missing_extension_falls_back_to_pure_python() -> None:
    assert probe({}, "hide") == f"python {GOLDEN}"


def test_require_native_turns_a_missing_extension_into_import_error() -> None:
    out = probe({"INFERENCECACHE_REQUIRE_NATIVE": "1"}, "hide")
    assert out.startswith("ImportError") and "INFERENCECACHE_REQUIRE_NATIVE" in out
    # Both set: the build must exist, and the twin is used.
    if NATIVE is not None:
        both = {"INFERENCECACHE_REQUIRE_NATIVE": "1", "INFERENCECACHE_PURE_PYTHON": "1"}
        assert probe(both) == f"python {GOLDEN}"


API = (
    "prefix_hashes",
    "chain",
    "chain_packed",
    "chain_from_varints",
    "varint_count",
    "decode_varints",
    "split_packed",
    "xxh3_64",
)


@pytest.mark.skipif(NATIVE is None, reason="C accelerator not built")
@pytest.mark.parametrize("name", API)
def test_twins_have_the_same_signatures(name: str) -> None:
    """Same parameter names, kinds and defaults: callers can switch freely."""
    import inspect

    from inferencecache.fingerprint import pure

    def shape(fn: object) -> list[tuple[str, object, object]]:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

    assert shape(getattr(NATIVE, name)) == shape(getattr(pure, name))


def test_public_api_is_the_active_twin() -> None:
    import inferencecache.fingerprint as fp
    from inferencecache.fingerprint import pure

    source = NATIVE if fp.IMPLEMENTATION == "native" else pure
    for name in API[:-1]:
        assert getattr(fp, name) is getattr(source, name)
