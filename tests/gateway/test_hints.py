"""cache_aware routing against a real ``inferencecache`` server (and a scripted one for faults).

Hints are loaded the way a subscriber loads them (ReportCacheState with the chain of the tokens
an engine cached); the gateway must compute the same chain from the request and route there.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from inferencecache import fingerprint
from inferencecache.config import HostPort
from inferencecache.procs import free_port
from inferencecache.server.testing import running_server
from inferencecache.tokenize.openai import load_engine_tokenizers
from tests.gateway.grpcfake import FakeHints, fake_hint_server
from tests.gateway.support import (
    client,
    dead_url,
    engines,
    engines_flag,
    gateway,
    host_port,
    metric_value,
    post,
    report,
    settings,
    wait_until,
)
from tests.tokenize.tinytok import write_model

P = list(range(1000, 1128))  # 8 blocks of 16
Q = list(range(5000, 5128))


def load(srv, *updates):
    stub = srv.stub()
    ack = stub.ReportCacheState(iter(updates), timeout=5)
    assert ack.accepted


def route_of(headers):
    return headers["X-Cache-Route-Replica"], headers["X-Cache-Route-Reason"], headers[
        "X-Cache-Route-Fallback"
    ]


@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_prefix_match_routes_to_the_warm_replica(transport: str):
    """Over gRPC (``--server``) and over the HTTP lookup listener (``--lookup-url``) alike."""
    with running_server(lookup_http=True) as srv:
        load(srv, report("r1", P), report("r0", Q))
        via = {"lookup_url": srv.lookup_url} if transport == "http" else {}
        async with engines("a", "b") as stubs, gateway(
            settings(engines_flag(stubs), server=host_port(srv.grpc_target), **via)
        ) as (_, url), client() as c:
            for _ in range(4):
                status, headers, body = await post(c, url, {"model": "m", "prompt": P + [7] * 5})
                assert status == 200 and body["served_by"] == "b"
                assert route_of(headers) == ("r1", "PREFIX_MATCH", "false")
                assert headers["X-Cache-Route-Matched-Tokens"] == "128"
                assert int(headers["X-Cache-Route-Hint-Us"]) > 0
            status, headers, _ = await post(c, url, {"model": "m", "prompt": Q})
            assert route_of(headers) == ("r0", "PREFIX_MATCH", "false")
            page = (await (await c.get(url + "/metrics")).read()).decode()
            assert metric_value(
                page, "inferencecache_gateway_hints_total", reason_code="PREFIX_MATCH"
            ) == 5
            assert metric_value(page, "inferencecache_gateway_hint_latency_seconds_count") == 5


async def test_string_prompt_is_tokenized_like_the_engine(tmp_path: Path):
    """Completions: the tokenizer's own special tokens (a BOS post-processor here) are added."""
    tok = write_model(tmp_path, "m", with_bos_post_processor=True)
    text = "the quick brown fox jumps over the lazy dog " * 12
    ids = tok.encode(text).ids
    assert ids[0] == tok.token_to_id("<s>") and len(ids) >= 64
    with running_server() as srv:
        load(srv, report("r1", ids), report("r0", Q))
        async with engines("a", "b") as stubs, gateway(
            settings(engines_flag(stubs), server=host_port(srv.grpc_target)),
            tokenizers=load_engine_tokenizers(tmp_path),
        ) as (_, url), client() as c:
            status, headers, _ = await post(c, url, {"model": "m", "prompt": text})
            assert status == 200
            assert route_of(headers) == ("r1", "PREFIX_MATCH", "false")
            assert headers["X-Cache-Route-Prompt-Tokens"] == str(len(ids))
            # vLLM's add_special_tokens=false drops the BOS: a different chain, no match on r1
            _, headers, _ = await post(
                c, url, {"model": "m", "prompt": text, "add_special_tokens": False}
            )
            assert headers["X-Cache-Route-Prompt-Tokens"] == str(len(ids) - 1)
            assert headers["X-Cache-Route-Reason"] != "PREFIX_MATCH"


async def test_chat_is_rendered_over_all_messages_with_the_generation_prompt(tmp_path: Path):
    tok = write_model(tmp_path, "m", with_bos_post_processor=True)
    system = "the quick brown fox " * 10
    user = "jumps over the lazy dog " * 10
    rendered = f"<s><|system|>\n{system}</s>\n<|user|>\n{user}</s>\n<|assistant|>\n"
    ids = tok.encode(rendered, add_special_tokens=False).ids
    with running_server() as srv:
        load(srv, report("r0", ids), report("r1", Q))
        async with engines("a", "b") as stubs, gateway(
            settings(engines_flag(stubs), server=host_port(srv.grpc_target)),
            tokenizers=load_engine_tokenizers(tmp_path),
        ) as (_, url), client() as c:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            status, headers, _ = await post(
                c, url, {"model": "m", "messages": messages}, path="/v1/chat/completions"
            )
            assert status == 200
            assert route_of(headers) == ("r0", "PREFIX_MATCH", "false")
            assert headers["X-Cache-Route-Prompt-Tokens"] == str(len(ids))


async def test_tenant_comes_from_the_header():
    with running_server() as srv:
        load(srv, report("r1", P, tenant="acme"), report("r0", Q, tenant="acme"))
        async with engines("a", "b") as stubs:
            async with gateway(
                settings(engines_flag(stubs), server=host_port(srv.grpc_target))
            ) as (_, url), client() as c:
                _, headers, _ = await post(
                    c, url, {"model": "m", "prompt": P}, headers={"X-Tenant-Id": "acme"}
                )
                assert route_of(headers) == ("r1", "PREFIX_MATCH", "false")
                _, headers, _ = await post(c, url, {"model": "m", "prompt": P})  # "default"
                assert headers["X-Cache-Route-Reason"] == "UNKNOWN_TENANT"
                assert headers["X-Cache-Route-Fallback"] == "true"
            async with gateway(
                settings(
                    engines_flag(stubs),
                    server=host_port(srv.grpc_target),
                    tenant_header="X-Org",
                    tenant_id="acme",
                )
            ) as (_, url), client() as c:
                _, headers, _ = await post(c, url, {"model": "m", "prompt": P})
                assert route_of(headers) == ("r1", "PREFIX_MATCH", "false")
                _, headers, _ = await post(
                    c, url, {"model": "m", "prompt": P}, headers={"X-Org": "nobody"}
                )
                assert headers["X-Cache-Route-Reason"] == "UNKNOWN_TENANT"


async def test_lora_adapters_are_discovered_from_the_engines_models():
    """``model`` naming an adapter -> LookupRoute model_id = its parent, adapter_id = the name."""
    models = [{"id": "m"}, {"id": "sql-lora", "parent": "m", "root": "/a"}]
    with running_server() as srv:
        load(srv, report("r1", P, adapter="sql-lora"), report("r0", P))
        async with engines("a", "b", models=models) as stubs, gateway(
            settings(engines_flag(stubs), server=host_port(srv.grpc_target))
        ) as (_, url), client() as c:
            _, headers, _ = await post(c, url, {"model": "sql-lora", "prompt": P})
            assert route_of(headers) == ("r1", "PREFIX_MATCH", "false")
            assert stubs[1].completions[-1].json["model"] == "sql-lora"
            _, headers, _ = await post(c, url, {"model": "m", "prompt": P})
            assert route_of(headers) == ("r0", "PREFIX_MATCH", "false")
            status, _, _ = await post(c, url, {"model": "chat-lora", "prompt": P})
            assert status == 404


async def test_lookup_request_carries_chain_tenant_scheme_and_adapter():
    fake = FakeHints(reason_code="PREFIX_MATCH", replicas=("r1",), matched=64)
    with fake_hint_server(fake) as target:
        async with engines("a", "b") as stubs, gateway(
            settings(
                engines_flag(stubs),
                server=host_port(target),
                adapters="sql-lora=m",
                discover_models=False,
                hash_scheme="sglang",
                block_size=32,
            )
        ) as (_, url), client() as c:
            _, headers, _ = await post(
                c, url, {"model": "sql-lora", "prompt": P + [1] * 10},
                headers={"X-Tenant-Id": "acme"},
            )
            assert route_of(headers) == ("r1", "PREFIX_MATCH", "false")
            assert headers["X-Cache-Route-Matched-Tokens"] == "64"
    (req,) = fake.requests
    hashes, counts = fingerprint.chain(P + [1] * 10, 32)
    assert (req.model_id, req.adapter_id, req.tenant_id, req.hash_scheme) == (
        "m", "sql-lora", "acme", "sglang",
    )
    assert list(req.block_hashes) == hashes and list(req.block_token_counts) == counts == [32] * 4
    assert not req.token_ids and not req.prompt_text


async def test_no_hint_on_an_empty_index_falls_back_to_round_robin():
    with running_server() as srv:
        async with engines("a", "b") as stubs, gateway(
            settings(engines_flag(stubs), server=host_port(srv.grpc_target))
        ) as (_, url), client() as c:
            picks = []
            for _ in range(4):
                status, headers, _ = await post(c, url, {"model": "m", "prompt": P})
                assert status == 200
                assert headers["X-Cache-Route-Reason"] == "NO_HINT"
                assert headers["X-Cache-Route-Fallback"] == "true"
                picks.append(headers["X-Cache-Route-Replica"])
            assert picks == ["r0", "r1", "r0", "r1"]
            page = (await (await c.get(url + "/metrics")).read()).decode()
            fallbacks = "inferencecache_gateway_fallbacks_total"
            assert metric_value(page, fallbacks, cause="no_hint") == 4


async def test_affinity_hint_is_followed_for_a_novel_prefix():
    with running_server() as srv:
        load(srv, report("r0", P), report("r1", Q))
        async with engines("a", "b") as stubs, gateway(
            settings(engines_flag(stubs), server=host_port(srv.grpc_target))
        ) as (_, url), client() as c:
            novel = list(range(9000, 9064))
            seen = set()
            for _ in range(3):
                _, headers, _ = await post(c, url, {"model": "m", "prompt": novel})
                assert headers["X-Cache-Route-Reason"] == "AFFINITY_HINT"
                assert headers["X-Cache-Route-Fallback"] == "false"
                seen.add(headers["X-Cache-Route-Replica"])
            assert len(seen) == 1  # the same novel prefix always lands on the same replica


async def test_unknown_model_is_logged_and_falls_back(caplog: pytest.LogCaptureFixture):
    with running_server() as srv:
        load(srv, report("r0", P))
        models = [{"id": "m"}, {"id": "m2"}]
        async with engines("a", "b", models=models) as stubs, gateway(
            settings(engines_flag(stubs), server=host_port(srv.grpc_target))
        ) as (_, url), client() as c:
            with caplog.at_level(logging.WARNING, logger="inferencecache.gateway"):
                for _ in range(2):
                    status, headers, _ = await post(c, url, {"model": "m2", "prompt": P})
                    assert status == 200
                    assert headers["X-Cache-Route-Reason"] == "UNKNOWN_MODEL"
                    assert headers["X-Cache-Route-Fallback"] == "true"
            warnings = [r for r in caplog.records if "UNKNOWN_MODEL" in r.getMessage()]
            assert len(warnings) == 1  # rate limited
            page = (await (await c.get(url + "/metrics")).read()).decode()
            fallbacks = "inferencecache_gateway_fallbacks_total"
            assert metric_value(page, fallbacks, cause="unknown") == 2


@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_server_down_never_fails_a_request(transport: str):
    via = {"lookup_url": dead_url()} if transport == "http" else {}
    async with engines("a", "b") as stubs, gateway(
        settings(engines_flag(stubs), server=HostPort("127.0.0.1", free_port()), **via)
    ) as (_, url), client() as c:
        picks = []
        for _ in range(4):
            status, headers, body = await post(c, url, {"model": "m", "prompt": P})
            assert status == 200 and body["choices"]
            assert headers["X-Cache-Route-Reason"] == "HINT_ERROR"
            assert headers["X-Cache-Route-Fallback"] == "true"
            picks.append(headers["X-Cache-Route-Replica"])
        assert picks == ["r0", "r1", "r0", "r1"]
        page = (await (await c.get(url + "/metrics")).read()).decode()
        assert metric_value(
            page, "inferencecache_gateway_fallbacks_total", cause="server_error"
        ) == 4


async def test_lookup_timeout_falls_back():
    fake = FakeHints(reason_code="PREFIX_MATCH", replicas=("r1",), delay=0.5)
    with fake_hint_server(fake) as target:
        async with engines("a", "b") as stubs, gateway(
            settings(engines_flag(stubs), server=host_port(target), lookup_timeout=0.03)
        ) as (_, url), client() as c:
            status, headers, _ = await post(c, url, {"model": "m", "prompt": P})
            assert status == 200
            assert headers["X-Cache-Route-Reason"] == "HINT_TIMEOUT"
            assert headers["X-Cache-Route-Replica"] == "r0"  # round robin, not the late hint
            page = (await (await c.get(url + "/metrics")).read()).decode()
            fallbacks = "inferencecache_gateway_fallbacks_total"
            assert metric_value(page, fallbacks, cause="timeout") == 1


@pytest.mark.parametrize(
    ("code", "reason"),
    [("TIMEOUT", "TIMEOUT"), ("SOMETHING_NEW", "UNRECOGNIZED"),
     ("POLICY_REQUIRES_CHAIN", "POLICY_REQUIRES_CHAIN")],
)
async def test_other_server_codes_fall_back(code, reason):
    fake = FakeHints(reason_code=code, replicas=("r1",))
    with fake_hint_server(fake) as target:
        async with engines("a", "b") as stubs, gateway(
            settings(engines_flag(stubs), server=host_port(target))
        ) as (_, url), client() as c:
            _, headers, _ = await post(c, url, {"model": "m", "prompt": P})
            assert route_of(headers) == ("r0", reason, "true")


async def test_default_gateway_moves_a_weak_match_to_the_least_loaded_replica():
    """The default load guard: a PREFIX_MATCH covering < 30% of the prompt is not followed;
    ``--routing-params min_match_fraction=0`` follows it again."""
    fake = FakeHints(reason_code="PREFIX_MATCH", replicas=("r1",), matched=16)  # 16 of 128
    with fake_hint_server(fake) as target:
        async with engines("a", "b") as stubs:
            async with gateway(settings(engines_flag(stubs), server=host_port(target))) as (
                _, url
            ), client() as c:
                _, headers, _ = await post(c, url, {"model": "m", "prompt": P})
                assert headers["X-Cache-Route-Reason"] == "LOAD_BALANCE"
                assert headers["X-Cache-Route-Fallback"] == "false"
            async with gateway(settings(engines_flag(stubs), server=host_port(target),
                                        routing_params="min_match_fraction=0")) as (
                _, url
            ), client() as c:
                _, headers, _ = await post(c, url, {"model": "m", "prompt": P})
                assert route_of(headers) == ("r1", "PREFIX_MATCH", "false")


async def test_hinted_replica_down_falls_back_to_a_healthy_one():
    fake = FakeHints(reason_code="PREFIX_MATCH", replicas=("r1",), matched=128)
    with fake_hint_server(fake) as target:
        async with engines("a") as stubs, gateway(
            settings(f"r0={stubs[0].url},r1={dead_url()}", server=host_port(target))
        ) as (_, url), client() as c:
            status, headers, _ = await post(c, url, {"model": "m", "prompt": P})
            assert status == 200
            assert route_of(headers) == ("r0", "HINTED_REPLICA_UNHEALTHY", "true")


async def test_prompt_shorter_than_a_block_is_not_looked_up():
    fake = FakeHints(reason_code="PREFIX_MATCH", replicas=("r1",))
    with fake_hint_server(fake) as target:
        async with engines("a", "b") as stubs, gateway(
            settings(engines_flag(stubs), server=host_port(target))
        ) as (_, url), client() as c:
            _, headers, _ = await post(c, url, {"model": "m", "prompt": [1] * 15})
            assert route_of(headers) == ("r0", "HINT_SKIPPED", "true")
            assert "X-Cache-Route-Hint-Us" not in headers
    assert fake.requests == []


async def test_a_server_that_comes_up_later_is_used():
    port = free_port()
    # The whole prompt matched: a real PREFIX_MATCH (the default load guard moves a match
    # covering < 30% of the prompt to the least loaded replica).
    fake = FakeHints(reason_code="PREFIX_MATCH", replicas=("r1",), matched=len(P))
    async with engines("a", "b") as stubs, gateway(
        settings(engines_flag(stubs), server=HostPort("127.0.0.1", port), lookup_timeout=0.2)
    ) as (_, url), client() as c:
        _, headers, _ = await post(c, url, {"model": "m", "prompt": P})
        assert headers["X-Cache-Route-Reason"] in ("HINT_ERROR", "HINT_TIMEOUT")
        with fake_hint_server(fake, port=port):

            async def routed() -> bool:
                _, h, _ = await post(c, url, {"model": "m", "prompt": P})
                return h["X-Cache-Route-Reason"] == "PREFIX_MATCH"

            await wait_until(routed, timeout=10)


async def test_http_hint_client_times_out_and_survives_bad_answers():
    """A listener that answers late, not 200, or without a length: a hint code, never an
    exception, and the next lookup still works on a fresh connection."""
    import asyncio

    from inferencecache.gateway.hints import HttpHintClient

    answers = [b"", b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n",
               b"HTTP/1.1 200 OK\r\n\r\n"]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        answer = answers.pop(0) if answers else None
        if answer:
            writer.write(answer)
            await writer.drain()
            writer.close()
        elif answer is None:  # a real answer from the real server below would do: time out
            await asyncio.sleep(1)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    chain = fingerprint.chain_packed(P, 16)
    client = HttpHintClient(f"http://127.0.0.1:{port}", 0.2, "vllm", 16)
    try:
        assert await client.start(1.0)
        got = [(await client.lookup("t", "m", "", chain)).reason_code for _ in range(4)]
        assert got == ["HINT_TIMEOUT", "HINT_ERROR", "HINT_ERROR", "HINT_TIMEOUT"]
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
    with running_server(lookup_http=True) as srv:
        load(srv, report("r1", P))
        client = HttpHintClient(srv.lookup_url, 1.0, "vllm", 16)
        try:
            for _ in range(3):
                hint = await client.lookup("default", "m", "", chain)
                assert hint.reason_code == "PREFIX_MATCH" and hint.replicas == ("r1",)
        finally:
            await client.close()
