"""Fingerprint benchmark: 8192 token ids → 512-hash chain (B=16), per entry point and twin.

    python bench/fingerprint.py [--quick] [--json]

Prints the median µs per call of every entry point for the C accelerator and the pure-Python
twin, next to two floors measured in the same run: one XXH3 call over the same 32 KiB (the
`xxhash` package's, SIMD) and 512 `xxhash` calls on 64-byte pieces from Python (what any
pure-Python chain pays at least). `run(quick)` returns the figures as a dict for bench/run.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import struct
import sys
import time
from array import array
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import xxhash

from inferencecache import fingerprint, varint
from inferencecache.fingerprint import pure

TOKENS = 8192
BLOCK = 16
SEED = 1337
VOCAB = 128_000  # a Llama-3-sized vocabulary: ids take 1-3 varint bytes, mostly 3


def _native() -> ModuleType | None:
    try:
        from inferencecache.fingerprint import _native
    except ImportError:
        return None
    return _native


def _median_us(fn: Callable[[], object], quick: bool) -> float:
    """Median µs per call over many timed batches (a batch lasts ≥ ~0.2 / 0.5 ms)."""
    t0 = time.perf_counter_ns()
    fn()
    once = max(time.perf_counter_ns() - t0, 1)
    batch = max(1, (200_000 if quick else 500_000) // once)
    rounds = 15 if quick else 201
    samples: list[float] = []
    gc.disable()
    try:
        for _ in range(3):  # warm-up
            fn()
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            for _ in range(batch):
                fn()
            samples.append((time.perf_counter_ns() - t0) / batch / 1000)
    finally:
        gc.enable()
    return statistics.median(samples)


def run(quick: bool = False) -> dict[str, Any]:
    """Measure everything; keys are stable for bench/run.py (µs unless named otherwise)."""
    rnd = random.Random(87)
    ids = [rnd.randrange(VOCAB) for _ in range(TOKENS)]
    ids_array = array("I", ids)
    ids_le32 = struct.pack(f"<{TOKENS}I", *ids)
    ids_varints = varint.encode_all(ids)
    pieces = [ids_le32[o : o + 4 * BLOCK] for o in range(0, len(ids_le32), 4 * BLOCK)]
    native = _native()

    res: dict[str, Any] = {
        "fingerprint_tokens": TOKENS,
        "fingerprint_block_size": BLOCK,
        "fingerprint_varint_bytes": len(ids_varints),
        "fingerprint_implementation": fingerprint.IMPLEMENTATION,
    }
    h = xxhash.xxh3_64_intdigest
    res["fingerprint_floor_bulk_us"] = _median_us(lambda: h(ids_le32, SEED), quick)
    res["fingerprint_floor_calls_us"] = _median_us(lambda: [h(p, SEED) for p in pieces], quick)

    impls: list[tuple[str, ModuleType]] = [("pure", pure)]
    if native is not None:
        impls.insert(0, ("native", native))
        res["fingerprint_floor_native_bulk_us"] = _median_us(
            partial(native.xxh3_64, ids_le32, SEED), quick
        )
    expected = pure.chain_packed(ids, BLOCK)
    for name, m in impls:
        cases: dict[str, Callable[[], object]] = {
            "list": partial(m.chain_packed, ids, BLOCK),
            "list_prefix_hashes": partial(m.prefix_hashes, ids, BLOCK),
            "list_chain": partial(m.chain, ids, BLOCK),
            "array": partial(m.chain_packed, ids_array, BLOCK),
            "bytes": partial(m.chain_packed, ids_le32, BLOCK),
            "varints": partial(m.chain_from_varints, ids_varints, BLOCK),
            "varint_count": partial(m.varint_count, ids_varints),
            "split_packed": partial(m.split_packed, expected),
        }
        assert m.chain_packed(ids, BLOCK) == expected
        assert m.chain_from_varints(ids_varints, BLOCK) == expected
        if name == "native" and not quick:  # other XXH3 length classes: 128 B and 256 B blocks
            cases["list_b32"] = partial(m.chain_packed, ids, 32)
            cases["list_b64"] = partial(m.chain_packed, ids, 64)
        for case, fn in cases.items():
            if quick and name == "pure" and case not in ("list", "varints"):
                continue
            res[f"fingerprint_{name}_{case}_us"] = _median_us(fn, quick)

    best = "native" if native is not None else "pure"
    res["fingerprint_us_8k"] = res[f"fingerprint_{best}_list_us"]
    res["fingerprint_us_8k_varints"] = res[f"fingerprint_{best}_varints_us"]
    res["fingerprint_floor_ratio"] = res["fingerprint_us_8k"] / res["fingerprint_floor_bulk_us"]
    res["fingerprint_vs_python_calls_ratio"] = (
        res["fingerprint_us_8k"] / res["fingerprint_floor_calls_us"]
    )
    return res


def _report(res: dict[str, Any]) -> str:
    bulk = res["fingerprint_floor_bulk_us"]
    calls = res["fingerprint_floor_calls_us"]
    lines = [
        f"fingerprint: {res['fingerprint_tokens']} ids → {res['fingerprint_tokens'] // BLOCK} "
        f"hashes (B={BLOCK}), varint payload {res['fingerprint_varint_bytes']} B; "
        f"active implementation: {res['fingerprint_implementation']}",
        f"{'case':<40} {'median µs':>10} {'÷ bulk':>8} {'÷ 512 calls':>12}",
    ]

    def row(label: str, us: float) -> None:
        lines.append(f"{label:<40} {us:>10.2f} {us / bulk:>8.2f} {us / calls:>12.3f}")

    row("floor: xxhash, one call over 32 KiB", bulk)
    if "fingerprint_floor_native_bulk_us" in res:
        row("floor: _native.xxh3_64 over 32 KiB", res["fingerprint_floor_native_bulk_us"])
    row("floor: 512 xxhash calls from Python", calls)
    labels = {
        "list": "chain_packed(list[int])",
        "list_prefix_hashes": "prefix_hashes(list[int])",
        "list_chain": "chain(list[int])",
        "array": "chain_packed(array('I'))",
        "bytes": "chain_packed(le32 bytes)",
        "varints": "chain_from_varints(payload)",
        "varint_count": "varint_count(payload)",
        "split_packed": "split_packed(512 hashes)",
        "list_b32": "chain_packed(list[int]), B=32",
        "list_b64": "chain_packed(list[int]), B=64",
    }
    for name in ("native", "pure"):
        for case, label in labels.items():
            key = f"fingerprint_{name}_{case}_us"
            if key in res:
                row(f"{name:<6} {label}", res[key])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    res = run(args.quick)
    print(json.dumps(res, indent=2) if args.json else _report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
