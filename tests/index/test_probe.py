"""The /probe self-test (contract-and-index.md §9.5), index side: body validation, stages,
cleanup."""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable
from typing import Any

import pytest

from inferencecache.index import PROBE_TENANT, Prober, ProbeRequestError, Reason
from inferencecache.index.probe import MAX_PROBE_BODY, decode_probe_body, probe_hash
from tests.index.support import Env, h, ids

BODY = b'{"backend":"lmcache-0","model":"m","hashScheme":"vllm"}'


def test_probe_ok_and_cleans_up(env: Env) -> None:
    env.legacy("r1", h(1), 64)
    before = (env.holds(), env.index.snapshot())
    reply = Prober(env.index).run(BODY)
    assert reply == {"backend": "lmcache-0", "ingest": "ok", "routing": "ok", "t2": "skipped"}
    assert (env.holds(), env.index.snapshot()) == before
    assert env.index.counts()["reserved_holds"] == 0
    assert env.index.cache_state(PROBE_TENANT, "m").replicas == []
    assert ids(env.exact(h(1))) == ["r1"]


def test_probe_hash_formula() -> None:
    def lp(s: bytes) -> bytes:
        return struct.pack(">I", len(s)) + s

    want = hashlib.sha256(
        b"inferencecache.io/probe/v1\n" + lp(b"vllm") + lp(b"m") + lp(b"b")
    ).digest()
    assert probe_hash("vllm", "m", "b") == want and len(want) == 32


def test_probe_keys_count_for_cold_start_only_while_present(env: Env) -> None:
    """Probe-tenant keys are real keys for the contract-and-index.md §5.7 cold-start check while
    they exist."""
    env.policy(affinity_routing=True)
    prober = Prober(env.index)
    seen: list[str] = []
    real_found = prober._found

    def spy(*args: Any) -> bool:
        seen.append(env.exact(h(5), tenant_id="x").reason_code)
        return real_found(*args)

    setattr(prober, "_found", spy)  # noqa: B010
    prober.run(BODY)
    assert seen == [Reason.UNKNOWN_TENANT]  # not a cold start while the probe block exists
    assert env.exact(h(5), tenant_id="x").reason_code == Reason.NO_HINT  # cold start again


class _Forgetful:
    """A store that accepts writes but never finds anything."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def holders(self, key: bytes, fresh_after: int) -> list[tuple[int, int, int, int]]:
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_probe_failure_reports_and_skips_later_stages(
    make_env: Callable[..., Env], store_factory: Callable[[], Any]
) -> None:
    env = make_env()
    env.index._state.store_factory = lambda: _Forgetful(store_factory())
    reply = Prober(env.index).run(BODY)
    assert (
        reply["ingest"] == "failed" and reply["routing"] == "skipped" and reply["t2"] == "skipped"
    )
    assert reply["errors"] == [{"stage": "ingest", "message": "probe block not found after ingest"}]
    assert env.index.counts()["holds"] == 0  # cleaned up anyway


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[]",
        b'{"backend":"b","model":"m"}',
        b'{"backend":"","model":"m","hashScheme":"vllm"}',
        b'{"backend":"b","model":"m","hashScheme":"vllm","extra":1}',
        b'{"backend":"b","model":"m","hashScheme":"vllm"} {}',
        b'{"backend":"b","model":"m","hashScheme":7}',
        b'{"backend":"b","model":"m","hashScheme":"' + b"x" * MAX_PROBE_BODY + b'"}',
    ],
)
def test_probe_body_rejects(body: bytes) -> None:
    with pytest.raises(ProbeRequestError):
        decode_probe_body(body)


def test_probe_body_optional_backend_type() -> None:
    req = decode_probe_body(b'{"backend":"b","model":"m","hashScheme":"s","backendType":"LMCache"}')
    assert (req.backend, req.model, req.hash_scheme, req.backend_type) == ("b", "m", "s", "LMCache")


def test_probes_of_one_backend_model_are_serialised(env: Env) -> None:
    prober = Prober(env.index)
    inside = 0
    overlap = False
    guard = threading.Lock()
    real = prober._probe

    def probe(req: Any) -> dict[str, object]:
        nonlocal inside, overlap
        with guard:
            inside += 1
            overlap = overlap or inside > 1
        try:
            threading.Event().wait(0.005)
            return real(req)
        finally:
            with guard:
                inside -= 1

    setattr(prober, "_probe", probe)  # noqa: B010
    replies: list[dict[str, object]] = []
    threads = [threading.Thread(target=lambda: replies.append(prober.run(BODY))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not overlap
    assert all(r["ingest"] == r["routing"] == "ok" for r in replies) and len(replies) == 8
    assert prober._locks == {}
    env.check()
