"""LookupPDRoute through a real gRPC client (contract-and-index.md §5.14)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferencecache import fingerprint
from inferencecache.config.reloading import ReloadingFile
from inferencecache.index.model import PROBE_TENANT
from inferencecache.index.pd_topology import (
    PDTopology,
    TopologyError,
    load_topology_file,
    parse_topology_document,
)
from inferencecache.index.tenant_config import IndexConfig
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from tests.server.helpers import CONFIG, MODEL, PERMISSIVE, TENANT, chain_entry, tokens, update

TOPO = PDTopology(
    name="pd1", transport="NIXL", prefill=("p0", "p1"), decode=("d0", "d1"), hash_scheme="vllm"
)
PROMPT = tokens(64)
HASHES, _ = fingerprint.chain(PROMPT, 16)
LAST = HASHES[-1]


@pytest.fixture
def srv() -> Iterator[RunningServer]:
    with running_server(config=CONFIG, pd_topologies={"pd1": TOPO}) as s:
        yield s


def report(s: RunningServer, *updates: pb.CacheStateUpdate) -> None:
    s.stub().ReportCacheState(iter(updates), timeout=10)


def stats(replica: str, pressure: float) -> pb.CacheStateUpdate:
    return update(replica, stats=pb.ReplicaStats(replica_id=replica, pressure=pressure))


def pd(
    s: RunningServer,
    ref: str = "pd1",
    *,
    prefix: bytes = LAST,
    tenant: str = TENANT,
    model: str = MODEL,
) -> pb.LookupPDRouteResponse:
    req = pb.LookupPDRouteRequest(
        model_id=model,
        tenant_id=tenant,
        prefix_hash=prefix,
        prefix_token_count=64,
        pd_topology_ref=ref,
    )
    resp: pb.LookupPDRouteResponse = s.stub().LookupPDRoute(req, timeout=10)
    return resp


def fleet(s: RunningServer) -> None:
    """p0 holds half the prompt, p1 all of it, decode d0 holds all of it too (a decode replica
    never prefills), x0 (outside the topology) holds it and is idle."""
    report(
        s,
        update("p0", [chain_entry(PROMPT[:32])]),
        update("p1", [chain_entry(PROMPT)]),
        update("d0", [chain_entry(PROMPT)]),
        update("x0", [chain_entry(PROMPT)]),
        stats("d0", 0.7),
        stats("d1", 0.2),
        stats("x0", 0.0),
    )


def test_c5_14_01_prefill_by_cache_decode_by_pressure(srv: RunningServer) -> None:
    fleet(srv)
    r = pd(srv)
    assert (r.reason_code, r.prefill_replica_id, r.decode_replica_id, r.transport_hint) == (
        "PREFIX_MATCH", "p1", "d1", "NIXL",
    )  # fmt: skip


def test_c5_14_02_prefill_uses_lookup_route_scoring(srv: RunningServer) -> None:
    """Both prefill replicas hold the prefix: LookupRoute's scoring (pressure factor) decides,
    and the answer is LookupRoute's best prefill-role replica."""
    report(
        srv,
        update("p0", [chain_entry(PROMPT)]),
        update("p1", [chain_entry(PROMPT)]),
        update("x0", [chain_entry(tokens(16, start=5000))]),  # DP: 2 of 3 in scope hold it
        stats("p0", 0.9),
        stats("p1", 0.1),
        stats("d0", 0.5),
    )
    lr = srv.stub().LookupRoute(
        pb.LookupRouteRequest(
            tenant_id=TENANT, model_id=MODEL, hash_scheme="vllm", prefix_hash=LAST,
            prefix_token_count=64,
        ),
        timeout=10,
    )  # fmt: skip
    assert [x.replica_id for x in lr.replica_scores] == ["p1", "p0"]
    assert pd(srv).prefill_replica_id == "p1"
    report(srv, stats("p0", 0.0), stats("p1", 0.9))
    assert pd(srv).prefill_replica_id == "p0"


def test_c5_14_03_unknown_topology(srv: RunningServer) -> None:
    fleet(srv)
    r = pd(srv, ref="nope")
    assert r == pb.LookupPDRouteResponse(reason_code="UNKNOWN_TOPOLOGY")
    assert pd(srv, ref="") == pb.LookupPDRouteResponse(reason_code="UNKNOWN_TOPOLOGY")


def test_c5_14_04_no_prefill_hint_picks_both_by_load(srv: RunningServer) -> None:
    fleet(srv)
    novel = fingerprint.chain(tokens(32, start=1000), 16)[0][-1]
    for prefix in (novel, b""):
        r = pd(srv, prefix=prefix)  # no prefill replica has reported stats: none is known live
        assert (r.reason_code, r.prefill_replica_id, r.decode_replica_id, r.transport_hint) == (
            "NO_PREFILL_REPLICA", "", "d1", "NIXL",
        )  # fmt: skip
    report(srv, stats("p0", 0.5), stats("p1", 0.1))
    for prefix in (novel, b""):
        r = pd(srv, prefix=prefix)
        assert (r.reason_code, r.prefill_replica_id, r.decode_replica_id, r.transport_hint) == (
            "NO_PREFILL_HINT", "p1", "d1", "NIXL",
        )  # fmt: skip


def test_c5_14_04_only_non_prefill_holders_is_no_prefill_hint(srv: RunningServer) -> None:
    report(srv, update("d0", [chain_entry(PROMPT)]), stats("d1", 0.3), stats("p0", 0.9))
    r = pd(srv)
    assert (r.reason_code, r.prefill_replica_id, r.decode_replica_id) == (
        "NO_PREFILL_HINT", "p0", "d1",
    )  # fmt: skip


def test_c5_14_05_no_decode_replica_without_fresh_stats(srv: RunningServer) -> None:
    report(srv, update("p1", [chain_entry(PROMPT)]), stats("x0", 0.0))
    r = pd(srv)
    assert (r.reason_code, r.prefill_replica_id, r.decode_replica_id, r.transport_hint) == (
        "NO_DECODE_REPLICA", "p1", "", "NIXL",
    )  # fmt: skip


def test_c5_14_05_stale_decode_stats_are_not_candidates() -> None:
    config = IndexConfig(policies={TENANT: PERMISSIVE})
    with running_server(config=config, pd_topologies={"pd1": TOPO}) as s:
        clock = s.backend.clock
        report(s, update("p1", [chain_entry(PROMPT)]))
        old = clock.now_us() - 31 * 60 * 1_000_000  # older than the 30 min default TTL
        report(
            s,
            update("d0", stats=pb.ReplicaStats(replica_id="d0", pressure=0.0), timestamp_us=old),
            stats("d1", 0.9),
        )
        r = pd(s)
    assert r.decode_replica_id == "d1", r


def test_c5_14_05_decode_ties_break_by_replica_id(srv: RunningServer) -> None:
    report(srv, stats("d1", 0.25), stats("d0", 0.25))
    assert pd(srv).decode_replica_id == "d0"


def test_c5_14_06_probe_and_empty_keys_are_no_hint(srv: RunningServer) -> None:
    fleet(srv)
    for tenant, model in ((PROBE_TENANT, MODEL), ("", MODEL), (TENANT, "")):
        r = pd(srv, tenant=tenant, model=model)
        assert r == pb.LookupPDRouteResponse(reason_code="NO_HINT"), (tenant, model)


def test_c5_14_06_no_topology_file_is_unknown_topology() -> None:
    with running_server(config=CONFIG) as s:
        assert pd(s) == pb.LookupPDRouteResponse(reason_code="UNKNOWN_TOPOLOGY")


def test_c5_14_07_reason_codes_are_counted(srv: RunningServer) -> None:
    fleet(srv)
    pd(srv)
    pd(srv, ref="nope")
    reg = srv.metrics.registry
    for code in ("PREFIX_MATCH", "UNKNOWN_TOPOLOGY"):
        v = reg.get_sample_value("inferencecache_pd_route_calls_total", {"reason_code": code})
        assert v == 1.0, code


# -- the topology file ---------------------------------------------------------------------------

YAML = """
topologies:
  - name: pd1
    transport: nixl
    prefill: [p0, p1]
    decode: [d0, d1]
"""


def test_c5_14_08_topology_file_yaml_and_json(tmp_path: Path) -> None:
    y = tmp_path / "pd.yaml"
    y.write_text(YAML)
    assert load_topology_file(y) == {"pd1": TOPO}  # transport normalised, scheme defaulted
    j = tmp_path / "pd.json"
    j.write_text(
        '{"topologies": [{"name": "m", "transport": "Mooncake", "hash_scheme": "sglang",'
        ' "prefill": ["a"], "decode": ["a", "b"]}]}'
    )
    assert load_topology_file(j) == {"m": PDTopology("m", "Mooncake", ("a",), ("a", "b"), "sglang")}


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        ({"topologies": [{"name": "a", "transport": "NIXL", "prefill": ["p"]}]},
         "topologies[0].decode"),
        ({"topologies": [{"name": "a", "transport": "TCP", "prefill": ["p"], "decode": ["d"]}]},
         "topologies[0].transport"),
        ({"topologies": [{"name": "a", "transport": "NIXL", "prefill": ["p"], "decode": ["d"],
                          "roles": 1}]}, "topologies[0].roles"),
        ({"topologies": [{"transport": "NIXL", "prefill": ["p"], "decode": ["d"]}]},
         "topologies[0].name"),
        ({"topologies": [{"name": "a", "transport": "NIXL", "prefill": ["p", "p"],
                          "decode": ["d"]}]}, "topologies[0].prefill[1]"),
        ({"topologies": [{"name": "a", "transport": "NIXL", "prefill": ["p"], "decode": ["d"]},
                         {"name": "a", "transport": "NIXL", "prefill": ["p"], "decode": ["d"]}]},
         "topologies[1].name"),
        ({"topology": []}, "topology"),
    ],
)  # fmt: skip
def test_c5_14_08_bad_topology_names_the_field(doc: object, path: str) -> None:
    with pytest.raises(TopologyError) as e:
        parse_topology_document(doc)
    assert e.value.path == path


def test_c5_14_09_topology_file_reloads_and_keeps_last_good(tmp_path: Path) -> None:
    y = tmp_path / "pd.yaml"
    y.write_text(YAML)
    with running_server(config=CONFIG) as s:
        topo = ReloadingFile(
            y, load_topology_file, kind="pd_topology", reloads=s.metrics.config_reloads, every=0
        )
        with running_server(config=CONFIG, pd_topologies=topo.get) as srv:
            fleet(srv)
            assert pd(srv).decode_replica_id == "d1"

            def rewrite(text: str, bump: int) -> None:
                y.write_text(text)
                st = y.stat()
                os.utime(y, ns=(st.st_atime_ns, st.st_mtime_ns + bump))

            rewrite(YAML.replace("decode: [d0, d1]", "decode: [d0]"), 1_000_000)
            assert pd(srv).decode_replica_id == "d0"
            rewrite("topologies: [{name: pd1}]", 2_000_000)  # invalid: last good stays
            assert pd(srv).decode_replica_id == "d0"
            reloads = s.metrics.registry.get_sample_value
            assert (
                reloads(
                    "inferencecache_server_config_reloads_total",
                    {"file": "pd_topology", "result": "error"},
                )
                == 1.0
            )
            assert (
                reloads(
                    "inferencecache_server_config_reloads_total",
                    {"file": "pd_topology", "result": "ok"},
                )
                == 1.0
            )


def test_c5_14_07_a_handler_exception_fails_open() -> None:
    def broken() -> dict[str, PDTopology]:
        raise RuntimeError("topology source broke")

    with running_server(config=CONFIG, pd_topologies=broken) as s:
        assert pd(s) == pb.LookupPDRouteResponse(reason_code="NO_HINT")
        v = s.metrics.registry.get_sample_value(
            "inferencecache_server_dropped_inputs_total",
            {"loop": "LookupPDRoute", "reason": "internal"},
        )
    assert v == 1.0
