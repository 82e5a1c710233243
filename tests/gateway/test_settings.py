"""Flag parsing of ``gateway`` (pure; the process-level checks are in test_command.py)."""

from __future__ import annotations

import pytest

from inferencecache.gateway.settings import GatewaySettings, parse_adapters, parse_engines
from inferencecache.routing.cache_aware import CacheAwarePolicy
from inferencecache.sim import cluster


def test_parse_engines_keeps_order_ids_and_normalises_urls():
    specs = parse_engines(" r0=http://127.0.0.1:8001/ , r1=https://[::1]:8443/prefix/ ,")
    assert [(s.replica_id, s.url) for s in specs] == [
        ("r0", "http://127.0.0.1:8001"),
        ("r1", "https://[::1]:8443/prefix"),
    ]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "no engines given"),
        ("r0", "is not replica_id=http://host:port"),
        ("=http://a:1", "is not replica_id"),
        ("r0=a:1", "want an http:// or https:// URL"),
        ("r0=http://a:99999", "is not a URL with a port"),
        ("r0=http://a:1?x=1", "must not carry"),
        ("r0=http://u:p@a:1", "must not carry"),
        ("r0=http://a:1,r0=http://b:1", "duplicate replica id"),
    ],
)
def test_parse_engines_errors(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_engines(text)


def test_parse_adapters():
    assert parse_adapters("sql-lora=tiny, chat=tiny,") == {"sql-lora": "tiny", "chat": "tiny"}
    for bad in ("x", "x=", "=y", "a=b,a=c"):
        with pytest.raises(ValueError):
            parse_adapters(bad)


def test_settings_defaults_match_the_documented_ones():
    s = GatewaySettings(engines="r0=http://127.0.0.1:8000")
    assert str(s.http_address) == "127.0.0.1:8090"
    assert str(s.server) == "127.0.0.1:9090"
    assert s.lookup_timeout == 0.05
    assert (s.routing_policy, s.tenant_header, s.tenant_id) == (
        "cache_aware", "X-Tenant-Id", "default",
    )
    assert (s.hash_scheme, s.block_size) == ("vllm", 16)
    assert s.policy_params == {}
    p = GatewaySettings(
        engines="r0=http://x:1", routing_policy="approximate", routing_params="capacity_blocks=9"
    )
    assert p.policy_params == {"capacity_blocks": 9}


def test_default_gateway_policy_runs_with_the_demos_load_guard():
    """``cache_aware`` (the default) gets the demo's guard; the library class keeps it off."""

    s = GatewaySettings(engines="r0=http://127.0.0.1:8000")
    policy = s.build_policy()
    assert isinstance(policy, CacheAwarePolicy)
    assert (policy.balance_abs_threshold, policy.balance_rel_threshold) == (4, 1.5)
    assert policy.min_match_fraction == 0.3
    assert s.effective_policy_params == cluster.default_policy_params(cluster.DEFAULT_ENGINE)[
        "cache_aware"
    ]
    bare = CacheAwarePolicy()
    assert (bare.balance_abs_threshold, bare.min_match_fraction) == (0, 0.0)


@pytest.mark.parametrize(
    ("policy", "want"),
    [
        ("oracle", {"balance_abs_threshold": 4}),
        ("approximate", {"balance_abs_threshold": 4, "match_threshold": 0.3}),
        ("round_robin", {}),
        ("random", {}),
    ],
)
def test_every_prefix_aware_policy_gets_the_guard_and_only_those(policy, want):
    s = GatewaySettings(engines="r0=http://x:1", routing_policy=policy)
    assert s.effective_policy_params == want
    built = s.build_policy()
    for k, v in want.items():
        assert getattr(built, k) == v


def test_routing_params_override_or_turn_off_the_guard():
    s = GatewaySettings(
        engines="r0=http://x:1", routing_params="balance_abs_threshold=0,min_match_fraction=0"
    )
    policy = s.build_policy()
    assert isinstance(policy, CacheAwarePolicy)
    assert (policy.balance_abs_threshold, policy.min_match_fraction) == (0, 0.0)
    s = GatewaySettings(engines="r0=http://x:1", routing_params="balance_abs_threshold=8")
    assert s.effective_policy_params == {"balance_abs_threshold": 8, "min_match_fraction": 0.3}


@pytest.mark.parametrize("url", ["127.0.0.1:8081", "https://h:1", "http://", "http://h:1/x"])
def test_lookup_url_must_be_an_http_base_url(url: str) -> None:
    with pytest.raises(ValueError, match="--lookup-url"):
        GatewaySettings(engines="r0=http://127.0.0.1:1", lookup_url=url)
    assert GatewaySettings(engines="r0=http://127.0.0.1:1", lookup_url="http://h:1").lookup_url


def test_lookup_url_and_event_log_are_exclusive() -> None:
    """One hint source per gateway: both given is a configuration error, not a silent pick."""
    with pytest.raises(ValueError, match="--lookup-url or --event-log"):
        GatewaySettings(engines="r0=http://127.0.0.1:1", lookup_url="http://h:1",
                        event_log="redis://127.0.0.1:6379/0")
    assert GatewaySettings(engines="r0=http://127.0.0.1:1",
                           event_log="redis://127.0.0.1:6379/0").event_log
