"""The fake and simulated engines' loops that read outside input survive any one input
(issue 15 item 1): the replay ROUTER over real ZeroMQ, the simulated engine's HTTP over real
HTTP (a real ``fake-engine --mode simulated`` process)."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from typing import Any

import zmq
import zmq.asyncio

from inferencecache.engines.publisher import EventPublisher
from inferencecache.kvevents.framing import pack_seq
from tests.engines.test_simulated_server import MODEL, get, post, start


async def test_replay_router_survives_hostile_requests_and_a_failing_answer() -> None:
    ctx = zmq.asyncio.Context()
    pub = EventPublisher(ctx, endpoint="tcp://127.0.0.1:0", fmt="vllm-0.33",
                         replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3)
    pub.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        pub.publish_payload(b"p0", live=False)
        dealer.connect(pub.replay_endpoint)
        for frames in ([b""], [b"", b""], [b"", b"\xff" * 8, b"x"], [b""] * 1000,
                       [b"", b"\x00" * 7], [b"", b"\x00" * 9], [b"x" * 2_000_000, pack_seq(0)]):
            await dealer.send_multipart(frames)
        real = pub._answer_replay
        raised = False

        async def flaky(router: Any, frames: list[bytes], limited: Any) -> None:
            nonlocal raised
            if not raised and frames[1:] == [b"", pack_seq(0)]:
                raised = True
                raise MemoryError
            await real(router, frames, limited)

        pub._answer_replay = flaky  # type: ignore[method-assign]
        await dealer.send_multipart([b"", pack_seq(0)])  # this answer fails
        await dealer.send_multipart([b"", pack_seq(2**64 - 1)])  # nothing that new: only the end
        await dealer.send_multipart([b"", pack_seq(0)])
        got = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(3)]
        assert [f[-2:] for f in got] == [[b"\xff" * 8, b""], [pack_seq(0), b"p0"],
                                         [b"\xff" * 8, b""]]
        assert pub.replay_errors == 1
    finally:
        dealer.close(linger=0)
        await pub.close()
        ctx.destroy(linger=0)


def post_raw(http: str, path: str, body: bytes) -> int:
    req = urllib.request.Request(f"http://{http}{path}", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        e.read()
        return int(e.code)


def test_simulated_engine_answers_worst_bodies_400_and_keeps_serving() -> None:
    proc, _endpoint, http = start()
    try:
        bodies = [
            b"[" * 100_000,
            b'{"a":' * 100_000,
            b'{"model": "sim-m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            b'{"model": "sim-m", "prompt": "\xff\xfe"}',
            b'{"model": "sim-m", "prompt": [18446744073709551616]}',
            b'{"model": "sim-m", "prompt": [1' + b"0" * 100_000 + b"]}",
            b'{"model": "sim-m", "messages": [{"role": "user", "content": '
            + b"[" * 50_000 + b"]" * 50_000 + b"}]}",
            b'{"model": "sim-m", "tokens": [-18446744073709551616]}',
        ]
        for path in ("/v1/completions", "/v1/chat/completions", "/debug/cache/match"):
            for body in bodies:
                status = post_raw(http, path, body)
                assert 400 <= status < 500, (path, body[:40], status)
        status, answer = post(http, "/v1/completions",
                              {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 1})
        assert status == 200 and answer["choices"]
        assert "inferencecache_engine_dropped_inputs_total{" not in get(http, "/metrics")
        assert proc.alive()
    finally:
        proc.stop()
