"""Every routing policy is selectable in the gateway and sees what it needs."""

from __future__ import annotations

from collections import Counter

from tests.gateway.support import client, engines, engines_flag, gateway, post, settings

P = list(range(1000, 1064))
Q = list(range(2000, 2064))


async def test_random_policy_spreads_and_is_seeded():
    async with engines("a", "b", "c") as stubs:
        runs = []
        for _ in range(2):
            async with gateway(
                settings(engines_flag(stubs), routing_policy="random", routing_params="seed=5")
            ) as (_, url), client() as c:
                picks = []
                for _ in range(30):
                    _, headers, _ = await post(c, url, {"model": "m", "prompt": [1]})
                    assert headers["X-Cache-Route-Reason"] == "RANDOM"
                    picks.append(headers["X-Cache-Route-Replica"])
                runs.append(picks)
        assert runs[0] == runs[1]
        assert set(Counter(runs[0])) == {"r0", "r1", "r2"}


async def test_approximate_policy_remembers_where_a_prefix_went():
    async with engines("a", "b", "c") as stubs, gateway(
        settings(engines_flag(stubs), routing_policy="approximate")
    ) as (_, url), client() as c:
        _, h1, _ = await post(c, url, {"model": "m", "prompt": P})
        _, h2, _ = await post(c, url, {"model": "m", "prompt": Q})
        assert h1["X-Cache-Route-Reason"] == h2["X-Cache-Route-Reason"] == "APPROX_NEW"
        assert h1["X-Cache-Route-Replica"] != h2["X-Cache-Route-Replica"]
        for _ in range(3):
            _, h, _ = await post(c, url, {"model": "m", "prompt": P + [9] * 20})
            assert h["X-Cache-Route-Reason"] == "APPROX_PREFIX"
            assert h["X-Cache-Route-Replica"] == h1["X-Cache-Route-Replica"]
            assert h["X-Cache-Route-Fallback"] == "false"


async def test_oracle_policy_asks_every_engine_and_takes_the_longest():
    lora = [{"id": "m"}, {"id": "sql-lora", "parent": "m"}]
    async with engines("a", oracle_tokens=16, models=lora) as a, engines(
        "b", oracle_tokens=48, models=lora
    ) as b, engines("c", oracle_tokens=32, models=lora) as cc, gateway(
                settings(engines_flag(a + b + cc), routing_policy="oracle")
            ) as (_, url), client() as c:
        _, headers, body = await post(c, url, {"model": "sql-lora", "prompt": P})
        assert body["served_by"] == "b"
        assert headers["X-Cache-Route-Reason"] == "ORACLE_PREFIX"
        assert headers["X-Cache-Route-Matched-Tokens"] == "48"
        assert int(headers["X-Cache-Route-Oracle-Us"]) > 0
        for stub in (a[0], b[0], cc[0]):
            assert stub.oracle_queries == [{"model": "sql-lora", "tokens": P}]


async def test_oracle_without_the_endpoint_falls_back_to_round_robin():
    async with engines("a", "b") as stubs, gateway(
        settings(engines_flag(stubs), routing_policy="oracle")
    ) as (_, url), client() as c:
        picks = []
        for _ in range(2):
            _, headers, _ = await post(c, url, {"model": "m", "prompt": P})
            assert headers["X-Cache-Route-Reason"] == "ORACLE_UNAVAILABLE"
            assert headers["X-Cache-Route-Fallback"] == "true"
            picks.append(headers["X-Cache-Route-Replica"])
        assert picks == ["r0", "r1"]


async def test_oracle_with_nothing_cached_anywhere_balances():
    async with engines("a", "b", oracle_tokens=0) as stubs, gateway(
        settings(engines_flag(stubs), routing_policy="oracle")
    ) as (_, url), client() as c:
        picks = set()
        for _ in range(4):
            _, headers, _ = await post(c, url, {"model": "m", "prompt": P})
            assert headers["X-Cache-Route-Reason"] == "ORACLE_NO_MATCH"
            picks.add(headers["X-Cache-Route-Replica"])
        assert picks == {"r0", "r1"}
