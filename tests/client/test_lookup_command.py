"""``inferencecache lookup`` as a process against a real in-process server."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferencecache.client.command import parse_token_list
from inferencecache.index.pd_topology import PDTopology
from inferencecache.procs import run_cli
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.tokenize import load_tokenizer_dir
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from tests.server.helpers import CONFIG, MODEL, TENANT, chain_entry, one_shot, tokens, update
from tests.tokenize.tinytok import write_model

TOKS = tokens(48, start=7)


@pytest.fixture
def srv() -> Iterator[RunningServer]:
    with running_server(config=CONFIG, lookup_http=True) as s:
        s.stub().ReportCacheState(one_shot(update("r1", [chain_entry(TOKS)])), timeout=10)
        yield s


def lookup(srv: RunningServer, *args: str) -> dict[str, object]:
    res = run_cli(
        ["lookup", "--server", srv.grpc_target, "--model-id", MODEL, "--tenant-id", TENANT, *args]
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert isinstance(doc, dict)
    return doc


def test_lookup_tokens_prints_the_response_as_json(srv: RunningServer) -> None:
    doc = lookup(srv, "--tokens", ",".join(map(str, TOKS)))
    assert doc["reason_code"] == "PREFIX_MATCH"
    scores = doc["replica_scores"]
    assert isinstance(scores, list) and scores[0]["replica_id"] == "r1"
    assert scores[0]["matched_tokens"] == 48
    assert scores[0]["tier"] == "CACHE_TIER_T1"
    # field names preserved, defaults printed
    assert doc["token_ids"] == [] and doc["adapter_id"] == ""
    assert set(doc) == {
        "replica_scores",
        "reason_code",
        "lookup_latency_us",
        "token_ids",
        "adapter_id",
    }


def test_c5_14_lookup_pd_topology_asks_lookup_pd_route() -> None:
    topo = PDTopology("pd", "Mooncake", prefill=("r1",), decode=("r2",))
    with running_server(config=CONFIG, pd_topologies={"pd": topo}) as s:
        s.stub().ReportCacheState(one_shot(update("r1", [chain_entry(TOKS)])), timeout=10)
        s.stub().ReportCacheState(
            one_shot(update("r2", stats=pb.ReplicaStats(replica_id="r2", pressure=0.5))),
            timeout=10,
        )
        doc = lookup(s, "--tokens", ",".join(map(str, TOKS)), "--pd-topology", "pd")
    assert doc == {
        "prefill_replica_id": "r1",
        "decode_replica_id": "r2",
        "transport_hint": "Mooncake",
        "reason_code": "PREFIX_MATCH",
    }


@pytest.mark.parametrize("chain", [False, True])
def test_lookup_over_http_prints_what_grpc_prints(srv: RunningServer, chain: bool) -> None:
    """``--lookup-url``: the same request over the HTTP lookup listener, the same answer."""
    extra = ["--client-chain"] if chain else []
    via_grpc = lookup(srv, "--tokens", ",".join(map(str, TOKS)), *extra)
    via_http = lookup(srv, "--tokens", ",".join(map(str, TOKS)), *extra,
                      "--lookup-url", srv.lookup_url)
    for doc in (via_grpc, via_http):  # latency and freshness-scaled values move with time
        doc.pop("lookup_latency_us")
        for score in doc["replica_scores"]:  # type: ignore[attr-defined]
            del score["score"], score["estimated_cache_hit_prob"]
    assert via_http == via_grpc and via_http["reason_code"] == "PREFIX_MATCH"


def test_lookup_over_http_unreachable_exits_1() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    res = run_cli(["lookup", "--lookup-url", f"http://127.0.0.1:{port}", "--model-id", "m",
                   "--tokens", "1,2,3"])
    assert res.returncode == 1 and "unreachable" in res.stderr


def test_lookup_client_chain_gives_the_same_answer(srv: RunningServer) -> None:
    doc = lookup(srv, "--tokens", ",".join(map(str, TOKS)), "--client-chain")
    assert doc["reason_code"] == "PREFIX_MATCH"
    # with a different block size the client's chain no longer matches the stored one
    other = lookup(
        srv, "--tokens", ",".join(map(str, TOKS)), "--client-chain", "--block-size", "32"
    )
    assert other["reason_code"] == "NO_HINT"


@pytest.mark.parametrize(
    "content",
    [
        " ".join(map(str, TOKS)) + "\n",
        ",\n".join(map(str, TOKS)),
        json.dumps(TOKS),
    ],
)
def test_lookup_token_file(srv: RunningServer, tmp_path: Path, content: str) -> None:
    f = tmp_path / "tokens.txt"
    f.write_text(content)
    assert lookup(srv, "--token-file", str(f))["reason_code"] == "PREFIX_MATCH"


def test_lookup_text_is_tokenized_by_the_server(tmp_path: Path) -> None:
    write_model(tmp_path, "org/tiny")
    tokenizers = load_tokenizer_dir(tmp_path)
    text = "hello world the quick brown fox " * 5
    expected = tokenizers.encode_chat("org/tiny", text)
    with running_server(config=CONFIG, tokenizer=tokenizers) as s:
        res = run_cli(
            [
                "lookup",
                "--server",
                s.grpc_target,
                "--model-id",
                "org/tiny",
                "--tenant-id",
                TENANT,
                "--text",
                text,
            ]
        )
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
    assert doc["token_ids"] == expected
    assert doc["reason_code"] == "NO_HINT"  # nothing ingested: cold start


def test_lookup_defaults_tenant_and_scheme(srv: RunningServer) -> None:
    res = run_cli(
        [
            "lookup",
            "--server",
            srv.grpc_target,
            "--model-id",
            MODEL,
            "--tokens",
            ",".join(map(str, TOKS)),
        ]
    )
    assert res.returncode == 0, res.stderr
    # tenant "default" has no keys while tenant "t" has: UNKNOWN_TENANT
    assert json.loads(res.stdout)["reason_code"] == "UNKNOWN_TENANT"


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "exactly one of"),
        (["--tokens", "1,2", "--text", "hi"], "exactly one of"),
        (["--tokens", "1,x,3"], "item 1"),
        (["--tokens", "4294967296"], "0..4294967295"),
        (["--tokens", "-1"], "item 0"),
        (["--tokens", ""], "empty token list"),
        (["--token-file", "/nonexistent/tokens"], "/nonexistent/tokens"),
        (["--text", "hi", "--client-chain"], "--client-chain"),
        (["--tokens", "1", "--timeout", "fast"], "--timeout"),
        (["--tokens", "1", "--server", "nohost"], "--server"),
        (["--tokens", "1", "--bogus"], "--bogus"),
        (["--text", "hi", "--pd-topology", "pd"], "--pd-topology"),
        (["--tokens", "1", "--pd-topology", "pd", "--lookup-url", "http://h:1"], "--pd-topology"),
    ],
)
def test_bad_input_lookup_usage_errors_exit_2(args: list[str], needle: str) -> None:
    res = run_cli(["lookup", "--model-id", MODEL, *args])
    assert res.returncode == 2, res.stderr
    assert needle in one_line(res.stderr)


def test_bad_input_lookup_requires_model_id() -> None:
    res = run_cli(["lookup", "--tokens", "1"])
    assert res.returncode == 2
    assert "--model-id" in one_line(res.stderr)


def test_lookup_unreachable_server_exits_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        res = run_cli(
            [
                "lookup",
                "--server",
                f"127.0.0.1:{port}",
                "--model-id",
                MODEL,
                "--tokens",
                "1",
                "--timeout",
                "5s",
            ]
        )
    assert res.returncode == 1
    line = one_line(res.stderr)
    assert "unreachable" in line and str(port) in line


def test_parse_token_list_forms() -> None:
    assert parse_token_list("1, 2,3\n4", "x") == [1, 2, 3, 4]
    assert parse_token_list("[5, 6]", "x") == [5, 6]
    with pytest.raises(ValueError, match="item 0"):
        parse_token_list("[true]", "x")
    with pytest.raises(ValueError, match="malformed token list"):
        parse_token_list("[1", "x")
