"""CI smoke of the benchmarks: correctness only, tiny sizes, never a timing assertion.

What runs here: the workload generator and its oracle; our index in process answering every
query of the smoke workload exactly as the oracle does (several checkpoints during ingest);
``bench/run.py --smoke`` as a file, producing every required JSON key; and Dynamo's answers
against the same oracle, in process and as a service, with the Dynamo peer installed into
``bench/.venv-peers`` (one ~75 MB wheel from PyPI, ~10 s here, cached). CI has PyPI: when the
peer cannot be installed those two tests FAIL with the reason (never skip), so a missing peer
cannot pass silently as "Dynamo checked".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import common, run, vs_dynamo, vs_dynamo_service
from bench.workload import REMOVED, SMOKE, STORED, Oracle, compare, generate
from inferencecache.procs import child_env

REPO = Path(__file__).resolve().parents[2]


def test_generator_is_seeded_and_prefix_closed() -> None:
    a, b = generate(SMOKE), generate(SMOKE)
    assert a.events == b.events and a.queries == b.queries and a.engine_hash == b.engine_hash
    kinds = {k for _w, k, _ids in a.events}
    assert {STORED, REMOVED} <= kinds  # the smoke workload evicts
    # every worker's cached set stays prefix-closed (the Oracle asserts each stored parent)
    o = Oracle(a)
    o.apply_until(len(a.events))
    parent = a.block_parent
    for cached in o.cached:
        assert all(parent[x] < 0 or parent[x] in cached for x in cached)


def test_oracle_answers_leading_runs_and_compare_flags_errors() -> None:
    wl = generate(SMOKE)
    o = Oracle(wl)
    o.apply_until(len(wl.events))
    want = o.answers(wl.queries)
    assert any(len(a) >= 2 for a in want)  # shared prefixes sit on several workers
    assert any(not a for a in want)  # some queries miss everywhere
    for q, ans in zip(wl.queries, want, strict=True):
        for worker, run_len in ans.items():
            assert all(b in o.cached[worker] for b in q[:run_len])
            assert run_len == len(q) or q[run_len] not in o.cached[worker]
    wrong = [dict(a) for a in want]
    first = next(i for i, a in enumerate(wrong) if a)
    w = next(iter(wrong[first]))
    wrong[first][w] += 1
    assert compare("x", wrong, want)
    assert not compare("x", want, want)


def test_our_index_matches_the_oracle() -> None:
    res = vs_dynamo.run(smoke=True, peer=False)
    assert res["inproc_correct"] is True
    assert res["inproc_checked_answers"] >= SMOKE.verify_queries * SMOKE.checkpoints


def _peer_or_fail() -> None:
    try:
        common.ensure_peer_venv()
    except common.PeerUnavailable as e:
        pytest.fail(
            f"Dynamo peer {common.DYNAMO_PACKAGE}=={common.DYNAMO_VERSION} could not be installed "
            f"into {common.PEER_VENV} ({e}); Dynamo's answers were NOT checked. This test needs "
            "PyPI (or a pre-built bench/.venv-peers).",
            pytrace=False,
        )


@pytest.mark.timeout(600)
def test_dynamo_in_process_matches_the_oracle() -> None:
    _peer_or_fail()
    res = vs_dynamo.run(smoke=True, peer=True)
    assert res["inproc_correct"] is True
    assert res["inproc_peer"] == f"{common.DYNAMO_PACKAGE}=={common.DYNAMO_VERSION}"


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_services_match_the_oracle() -> None:
    _peer_or_fail()
    res = vs_dynamo_service.run(smoke=True, peer=True)
    assert res["service_correct"] is True
    assert "service_ingest_speedup_vs_dynamo" not in res  # smoke reports no timing


def test_run_smoke_as_a_file_writes_every_key(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--smoke", "--no-peer",
         "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    for key in run.REQUIRED_KEYS:
        assert key in res
    assert res["inproc_correct"] is True
    assert res["errors"] == {}
    assert set(res["targets"]) == set(run.TARGETS)


def test_run_imports_as_a_module() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--quick" in proc.stdout
