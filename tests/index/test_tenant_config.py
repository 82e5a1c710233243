"""Per-tenant configuration: the --policy-file format and the /policy body
(contract-and-index.md §6.7, §9.4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferencecache.index import (
    IndexConfig,
    PolicyDecodeError,
    PolicyError,
    Strategy,
    TenantPolicy,
    TenantQuota,
    decode_policy_body,
    load_policy_file,
    parse_policy_document,
)
from inferencecache.index.tenant_config import MAX_POLICY_BODY, PolicyTable

EXAMPLE_YAML = """\
policies:
  - tenant_id: team-a
    eviction_ttl: 10m
    eviction: lfu
    minimum_prefix_tokens: 32
    minimum_matched_tokens: 0
    routing_floor_score: 0.5
    lookup_timeout_ms: 20
    affinity_routing: false
    strategy:
      enable_chain_matching: true
      require_chain: true
      enable_tenant_hot: false
  - tenant_id: team-b
    routing_floor_score: 0
tenants:
  - tenant_id: team-a
    max_index_entries: 100000
    isolation_mode: Fairness
"""


def test_policy_file_yaml_example(tmp_path: Path) -> None:
    p = tmp_path / "policy.yaml"
    p.write_text(EXAMPLE_YAML)
    cfg = load_policy_file(p)
    assert cfg.policies["team-a"] == TenantPolicy(
        eviction_ttl=600.0,
        eviction="lfu",
        minimum_prefix_tokens=32,
        minimum_matched_tokens=0,
        routing_floor_score=0.5,
        lookup_timeout_ms=20,
        affinity_routing=False,
        strategy=Strategy(enable_chain_matching=True, require_chain=True, enable_tenant_hot=False),
    )
    # absent fields take the defaults (config-file rule), present zeros win
    assert cfg.policies["team-b"] == TenantPolicy(routing_floor_score=0.0)
    assert cfg.quotas == {"team-a": TenantQuota(100_000, "Fairness")}


def test_docs_example_is_valid() -> None:
    """docs/index.md's YAML example parses (kept in sync by hand)."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "index.md"
    text = doc.read_text()
    start = text.index("```yaml\n") + len("```yaml\n")
    example = text[start : text.index("```", start)]
    cfg = parse_policy_document(__import__("yaml").safe_load(example))
    assert cfg.policies and cfg.quotas


def test_policy_file_json(tmp_path: Path) -> None:
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"policies": [{"tenant_id": "x", "eviction_ttl": "1h30m"}]}))
    assert load_policy_file(p).policies["x"].eviction_ttl == 5400.0
    p.write_text("")
    with pytest.raises(PolicyError, match="not valid"):
        load_policy_file(p)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_policy_file(empty) == IndexConfig()
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy_file(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        ({"policy": []}, "policy"),
        ({"policies": {}}, "policies"),
        ({"policies": [{"tenant_id": "a", "bogus": 1}]}, "policies[0].bogus"),
        ({"policies": [{}]}, "policies[0].tenant_id"),
        ({"policies": [{"tenant_id": 5}]}, "policies[0].tenant_id"),
        (
            {"policies": [{"tenant_id": "a"}, {"tenant_id": "b", "routing_floor_score": -1}]},
            "policies[1].routing_floor_score",
        ),
        (
            {"policies": [{"tenant_id": "a", "routing_floor_score": "high"}]},
            "policies[0].routing_floor_score",
        ),
        (
            {"policies": [{"tenant_id": "a", "routing_floor_score": float("nan")}]},
            "policies[0].routing_floor_score",
        ),
        (
            {"policies": [{"tenant_id": "a", "minimum_matched_tokens": -1}]},
            "policies[0].minimum_matched_tokens",
        ),
        (
            {"policies": [{"tenant_id": "a", "minimum_prefix_tokens": 1.5}]},
            "policies[0].minimum_prefix_tokens",
        ),
        (
            {"policies": [{"tenant_id": "a", "minimum_prefix_tokens": True}]},
            "policies[0].minimum_prefix_tokens",
        ),
        (
            {"policies": [{"tenant_id": "a", "lookup_timeout_ms": "5"}]},
            "policies[0].lookup_timeout_ms",
        ),
        (
            {"policies": [{"tenant_id": "a", "affinity_routing": "yes"}]},
            "policies[0].affinity_routing",
        ),
        ({"policies": [{"tenant_id": "a", "eviction": "fifo"}]}, "policies[0].eviction"),
        ({"policies": [{"tenant_id": "a", "eviction_ttl": "10"}]}, "policies[0].eviction_ttl"),
        ({"policies": [{"tenant_id": "a", "eviction_ttl": "-5m"}]}, "policies[0].eviction_ttl"),
        ({"policies": [{"tenant_id": "a", "eviction_ttl": 30}]}, "policies[0].eviction_ttl"),
        (
            {"policies": [{"tenant_id": "a", "strategy": {"chain": True}}]},
            "policies[0].strategy.chain",
        ),
        (
            {"policies": [{"tenant_id": "a", "strategy": {"require_chain": 1}}]},
            "policies[0].strategy.require_chain",
        ),
        (
            {
                "policies": [
                    {
                        "tenant_id": "a",
                        "strategy": {"require_chain": True, "enable_chain_matching": False},
                    }
                ]
            },
            "policies[0].strategy.require_chain",
        ),
        ({"policies": [{"tenant_id": "a"}, {"tenant_id": "a"}]}, "policies[1].tenant_id"),
        ({"tenants": [{"tenant_id": "a"}]}, "tenants[0].max_index_entries"),
        (
            {"tenants": [{"tenant_id": "a", "max_index_entries": "9"}]},
            "tenants[0].max_index_entries",
        ),
        ({"tenants": [{"tenant_id": "a", "max_index_entries": 1, "mode": "x"}]}, "tenants[0].mode"),
        ([], ""),
    ],
)
def test_policy_file_errors_name_the_field(doc: object, path: str) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy_document(doc)
    assert e.value.path == path
    assert str(e.value).startswith(path) and "\n" not in str(e.value)


def test_policy_file_lenient_values() -> None:
    cfg = parse_policy_document(
        {
            "policies": [
                {"tenant_id": "", "eviction": "lfu"},  # empty tenant: ignored
                {"tenant_id": "a", "eviction": "LFU", "eviction_ttl": 0, "lookup_timeout_ms": -1},
                {"tenant_id": "b", "strategy": None, "routing_floor_score": 2},
            ],
            "tenants": [
                {"tenant_id": "", "max_index_entries": 5},
                {"tenant_id": "q", "max_index_entries": -4},
            ],
        }
    )
    assert set(cfg.policies) == {"a", "b"}
    assert cfg.policies["a"].eviction == "lfu" and cfg.policies["a"].eviction_ttl == 0.0
    assert cfg.policies["b"].routing_floor_score == 2.0
    table = PolicyTable(cfg, 1800 * 10**6)
    assert table.get("q").quota == 0  # negative quota acts as 0
    assert table.get("a").lfu and table.get("a").ttl_us == 1800 * 10**6
    assert table.get("a").lookup_timeout_ms == -1
    assert table.get("nobody") is table.default and table.default.quota is None


def _body(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_policy_body_full_v7() -> None:
    cfg = decode_policy_body(
        _body(
            {
                "version": 7,
                "policies": [
                    {
                        "namespace": "a",
                        "evictionTTL": 600_000_000_000,
                        "minimumPrefixTokens": 8,
                        "minimumMatchedTokens": 32,
                        "routingFloorScore": 0.25,
                        "lookupTimeoutMs": 15,
                        "affinityRouting": False,
                        "eviction": "LFU",
                        "strategy": {
                            "enableChainMatching": False,
                            "requireChain": True,
                            "enableTenantHot": False,
                        },
                    },
                    {"namespace": ""},
                ],
                "tenants": [
                    {"tenantID": "a", "maxIndexEntries": 10, "isolationMode": "Fairness"},
                    {"tenantID": ""},
                ],
            }
        )
    )
    assert cfg.policies == {
        "a": TenantPolicy(
            eviction_ttl=600.0,
            eviction="lfu",
            minimum_prefix_tokens=8,
            minimum_matched_tokens=32,
            routing_floor_score=0.25,
            lookup_timeout_ms=15,
            affinity_routing=False,
            strategy=Strategy(False, True, False),
        )
    }
    assert cfg.quotas == {"a": TenantQuota(10, "Fairness")}


def test_policy_body_absent_fields_follow_the_reference() -> None:
    cfg = decode_policy_body(
        _body({"version": 7, "policies": [{"namespace": "a"}], "tenants": [{"tenantID": "z"}]})
    )
    p = cfg.policies["a"]
    assert (p.eviction_ttl, p.minimum_prefix_tokens, p.lookup_timeout_ms) == (0.0, 0, 0)
    assert p.minimum_matched_tokens == 0  # v>=4: absent = 0 = G1 off
    assert p.routing_floor_score == 0.1 and p.affinity_routing is True
    assert p.strategy == Strategy()
    assert cfg.quotas["z"].max_index_entries == 0


@pytest.mark.parametrize(
    ("version", "matched", "floor", "strategy", "affinity"),
    [
        (3, 64, 0.1, Strategy(), True),
        (4, 0, 0.1, Strategy(), True),
        (5, 0, 0.7, Strategy(), True),
        (6, 0, 0.7, Strategy(False, False, False), True),
        (7, 0, 0.7, Strategy(False, False, False), False),
    ],
)
def test_policy_body_version_rules(
    version: int, matched: int, floor: float, strategy: Strategy, affinity: bool
) -> None:
    body = {
        "version": version,
        "policies": [
            {
                "namespace": "a",
                "routingFloorScore": 0.7,
                "affinityRouting": False,
                "strategy": {"enableChainMatching": False, "enableTenantHot": False},
            }
        ],
    }
    p = decode_policy_body(_body(body)).policies["a"]
    assert (p.minimum_matched_tokens, p.routing_floor_score, p.strategy, p.affinity_routing) == (
        matched,
        floor,
        strategy,
        affinity,
    )
    body["policies"][0]["minimumMatchedTokens"] = 16  # type: ignore[index]
    assert decode_policy_body(_body(body)).policies["a"].minimum_matched_tokens == 16


def test_policy_body_go_decoding_details() -> None:
    cfg = decode_policy_body(b'{"Version":7,"POLICIES":[{"NameSpace":"a","evictionttl":null}]}')
    assert "a" in cfg.policies
    cfg = decode_policy_body(b'{"version":7,"policies":null,"tenants":null}')
    assert cfg == IndexConfig()
    cfg = decode_policy_body(b'{"version":7,"policies":[{"namespace":"a","routingFloorScore":-2}]}')
    assert PolicyTable(cfg, 1).get("a").routing_floor_score == 0.0  # negative acts as 0


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[]",
        b'{"version":7} {}',
        b'{"version":7,"extra":1}',
        b'{"version":7,"policies":[{"namespace":"a","typo":1}]}',
        b'{"version":7,"policies":[{"namespace":"a","strategy":{"x":true}}]}',
        b'{"version":7,"tenants":[{"tenantId":"a","maxEntries":1}]}',
        b'{"version":2}',
        b'{"version":8}',
        b"{}",
        b'{"version":"7"}',
        b'{"version":7.0}',
        b'{"version":7,"policies":[{"namespace":1}]}',
        b'{"version":7,"policies":[{"namespace":"a","evictionTTL":1.5}]}',
        b'{"version":7,"policies":[{"namespace":"a","routingFloorScore":NaN}]}',
        b'{"version":7,"policies":[{"namespace":"a","affinityRouting":1}]}',
        b'{"version":7,"policies":{}}',
        b"\xff\xfe",
    ],
)
def test_policy_body_rejects(body: bytes) -> None:
    with pytest.raises(PolicyDecodeError):
        decode_policy_body(body)


def test_policy_body_size_bound() -> None:
    pad = b" " * (MAX_POLICY_BODY - len(b'{"version":7}'))
    assert decode_policy_body(b'{"version":7}' + pad) == IndexConfig()
    with pytest.raises(PolicyDecodeError, match="exceeds"):
        decode_policy_body(b'{"version":7}' + pad + b" ")


def test_index_config_is_immutable() -> None:
    cfg = IndexConfig(policies={"a": TenantPolicy()})
    with pytest.raises(TypeError):
        cfg.policies["b"] = TenantPolicy()  # type: ignore[index]
    with pytest.raises(AttributeError):
        cfg.policies = {}  # type: ignore[misc]
