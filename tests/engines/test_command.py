"""``inferencecache fake-engine`` as a process: flags, the fixed batch, scripts, replay, metrics
(engine-events-and-subscriber.md §11, §13 item 73)."""

from __future__ import annotations

import json
import time
import urllib.request

import msgspec
import pytest
import zmq

from inferencecache.cli import main
from inferencecache.kvevents import BlockStored, DecodedBatch, decode_batch
from inferencecache.kvevents.framing import (
    ReplayData,
    ReplayEnd,
    pack_seq,
    parse_live,
    parse_replay_reply,
)
from inferencecache.procs import Child, run_cli
from tests.subscriber.conftest import MapperKit

BASE = ["fake-engine", "--bind", "tcp://127.0.0.1:0", "--http-address", "127.0.0.1:0"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--block-size", "0"], "--block-size"),
        (["--num-blocks", "4", "--events", "5"], "--events"),
        (["--num-blocks", "0"], "--num-blocks"),
        (["--start-token", "-1"], "--start-token"),
        (["--num-blocks", "1048577"], "--num-blocks"),
        (["--start-token", "4294967290"], "--start-token"),
        (["--interval", "0"], "--interval"),
        (["--interval", "10"], "--interval"),
        (["--wire-format", "vllm-9.9"], "--wire-format"),
        (["--mode", "chaos"], "--mode"),
        (["--mode", "script"], "--script"),
        (["--workload", "random"], "--workload"),
        (["--lora-adapters", "sql-lora"], "--lora-adapters"),
        (["--http-address", "nope"], "--http-address"),
        (["--bind", "127.0.0.1:5557"], "--bind"),
        (["--omit-token-ids=maybe"], "--omit-token-ids"),
        (["--lora-fraction", "2"], "--lora-fraction"),
    ],
)
def test_bad_flag_values_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as e:
        main([*BASE, *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and err.count("\n") == 1, err


def test_help_lists_the_flags() -> None:
    r = run_cli(["fake-engine", "--help"])
    assert r.returncode == 0
    for flag in ("--bind", "--wire-format", "--mode", "--replay-endpoint", "--http-address",
                 "--num-blocks", "--omit-token-ids", "--script", "--seed"):
        assert flag in r.stdout


def _sub(endpoint: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub


def _recv(sock: zmq.Socket[bytes], timeout: float = 5.0) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), "nothing received"
    return sock.recv_multipart()


def test_s13_73_fixed_batch_process_and_its_expect_lines() -> None:
    with Child(*BASE, "--num-blocks", "4", "--events", "2", "--block-size", "16",
              "--interval", "50ms") as engine:
        ready = engine.wait_log("fake engine ready")
        engine.wait_log("EXPECT prefix_hash[3]")
        expect = [r["msg"] for r in engine.records if r["msg"].startswith("EXPECT")]
        assert expect == [
            "EXPECT prefix_hash[0]=d47a8f41c833328a token_count=16",
            "EXPECT prefix_hash[1]=bf15dffb16447f38 token_count=32",
            "EXPECT prefix_hash[2]=a4dda066f3c1e1a0 token_count=48",
            "EXPECT prefix_hash[3]=35f7c0d119848950 token_count=64",
        ]
        with zmq.Context() as ctx, _sub(ready["endpoint"], ctx) as sub:
            topic, seq, payload = parse_live(_recv(sub))
            _, seq2, payload2 = parse_live(_recv(sub))
            assert topic == b"" and seq2 == seq + 1 and payload2 == payload
        batch = decode_batch(payload)
        assert batch.ts == 0.0
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert len(stored) == 2 == len(batch.events)
        assert stored[0].block_hashes == [pack_seq(0xE000), pack_seq(0xE001)]
        assert stored[1].parent_block_hash == pack_seq(0xE001)
        assert stored[0].lora_id is None
        kit = MapperKit()
        for _ in range(2):
            kit.mapper.apply(batch)
        got = [f"EXPECT prefix_hash[{i % 4}]={e[0].hex()} token_count={e[1]}"
               for i, e in enumerate(kit.outbox.added())]
        assert got == expect * 2
        with urllib.request.urlopen(f"http://{ready['http_address']}/metrics", timeout=5) as r:
            text = r.read().decode()
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                     "vllm:num_requests_waiting", "vllm:prefix_cache_hits_total",
                     "vllm:prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total"):
            assert name in text
        assert 'model_name="fake-model"' in text
        assert engine.stop() == 0


def test_omit_token_ids_and_origin_wire_shape() -> None:
    with Child(*BASE, "--num-blocks", "2", "--omit-token-ids", "--wire-format", "vllm-0.9",
              "--interval", "50ms", "--topic", "kv-events") as engine:
        ready = engine.wait_log("fake engine ready")
        assert engine.wait_log("EXPECT no index entries")
        with zmq.Context() as ctx, _sub(ready["endpoint"], ctx) as sub:
            topic, _, payload = parse_live(_recv(sub))
        assert topic == b"kv-events"
        assert msgspec.msgpack.decode(payload) == [0.0, [["BlockStored", [0xE000, 0xE001], None,
                                                          None, 16, None]]]


def _replay(endpoint: str, start: int, ctx: zmq.Context[zmq.Socket[bytes]]) -> list[int]:
    with ctx.socket(zmq.DEALER) as d:
        d.connect(endpoint)
        d.send_multipart([b"", pack_seq(start)])
        out: list[int] = []
        while True:
            reply = parse_replay_reply(_recv(d))
            if isinstance(reply, ReplayEnd):
                return out
            assert isinstance(reply, ReplayData)
            out.append(reply.seq)


def test_script_from_stdin_with_replay() -> None:
    with Child("fake-engine", "--bind", "tcp://127.0.0.1:0", "--http-address", "",
              "--mode", "script", "--script", "-", "--replay-endpoint", "tcp://127.0.0.1:0",
              "--block-size", "4", stdin=True) as engine:
        ready = engine.wait_log("fake engine ready")
        assert ready["http_address"] == ""
        with zmq.Context() as ctx, _sub(ready["endpoint"], ctx) as sub:
            # Probe until the subscription is live (each probe is one published batch).
            deadline = time.monotonic() + 10
            while not sub.poll(50):
                assert time.monotonic() < deadline
                engine.send(json.dumps({"op": "clear"}))
            while sub.poll(200):
                sub.recv_multipart()
            first = engine.count("script step")
            engine.send(json.dumps({"op": "store", "tokens": list(range(12)),
                                    "lora_id": 1, "lora_name": "sql-lora"}))
            _, seq, payload = parse_live(_recv(sub))
            ev = decode_batch(payload).events[0]
            assert isinstance(ev, BlockStored)
            assert (len(ev.block_hashes), ev.lora_name, ev.block_size) == (3, "sql-lora", 4)
            engine.send(json.dumps({"ops": [{"op": "store", "tokens": list(range(100, 108))}],
                                    "live": False}))
            engine.send(json.dumps([{"op": "remove", "tokens": list(range(12)), "lora_id": 1,
                                     "lora_name": "sql-lora"}]))
            _, seq3, payload3 = parse_live(_recv(sub))
            assert seq3 == seq + 2  # seq + 1 went to the replay buffer only
            assert len(decode_batch(payload3).events) == 3  # one BlockRemoved per block
            assert _replay(ready["replay_endpoint"], seq + 1, ctx) == [seq + 1, seq + 2]
            engine.send("not json")
            engine.send("[1, 2]")  # ops that are not objects
            engine.send("[" * 100_000)  # nested deeper than the JSON parser goes
            engine.send(json.dumps({"op": "exit"}))
            assert engine.wait(10) == 0
        assert engine.count("script step") == first + 3
        assert engine.count("bad script line") == 3


def _decoded_events(endpoint: str) -> list[DecodedBatch]:
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as d:
        d.connect(endpoint)
        d.send_multipart([b"", pack_seq(0)])
        out: list[DecodedBatch] = []
        while True:
            reply = parse_replay_reply(_recv(d))
            if isinstance(reply, ReplayEnd):
                return out
            assert isinstance(reply, ReplayData)
            out.append(decode_batch(reply.payload))


def test_random_workload_is_deterministic_per_seed() -> None:
    runs = []
    for _ in range(2):
        with Child(*BASE, "--mode", "random", "--seed", "7", "--steps", "20",
                  "--interval", "0", "--gpu-blocks", "30", "--clear-every", "9",
                  "--lora-adapters", "1=sql-lora,2=chat-lora", "--lora-fraction", "0.5",
                  "--replay-endpoint", "tcp://127.0.0.1:0") as engine:
            ready = engine.wait_log("fake engine ready")
            done = engine.wait_log("workload done")
            assert done["steps"] == 20 and done["batches"] == 20
            runs.append([b.events for b in _decoded_events(ready["replay_endpoint"])])
    assert runs[0] == runs[1]
    events = [e for batch in runs[0] for e in batch]
    kinds = {type(e).__name__ for e in events}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert {e.lora_name for e in events if isinstance(e, BlockStored)} >= {"sql-lora", None}
