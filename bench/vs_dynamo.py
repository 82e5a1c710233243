"""Our index in process vs Dynamo's ``RadixTree``: same workload, same run, answers checked.

    python bench/vs_dynamo.py [--quick | --smoke] [--rounds N] [--no-peer] [--json]

The workload is ``bench/workload.py``'s seeded generator (N workers, shared prefixes, random
leaf evictions, occasional cache resets, queries with novel suffixes). Each side runs in its own
process: ours in the project's venv, Dynamo's (``bench/peer_dynamo.py``) in ``bench/.venv-peers``.
The driver (this process) only generates, sequences and checks; it never times anything itself.

What each side does with the same events (an *event* = one batch of one worker step):
- **ours** — what the server does per message, from the message's wire bytes: a stored batch
  is the ``CacheStateUpdate`` the subscriber sends (one legacy ``PrefixEntry`` per block:
  fingerprint + cumulative tokens, T1), parsed by the server's ReportCacheState deserializer
  (``server.report_request.parse_update_request``: C, one ``LegacyRun``) and applied with
  ``Index.apply_update``; a removed batch is one batched ``PREFIX_EVICTED`` ``CacheEvent``
  (``prefix_hash`` + ``prefix_hashes``, what ``subscribe --batch-evictions`` sends), parsed with
  protobuf (the server's PublishEvent deserializer) and applied with ``Index.apply_event``; a
  reset is one ``ALL_CLEARED``;
- **Dynamo** — ``RadixTree.apply_event(worker, json_bytes)`` with the serde ``KvCacheEvent``
  (``block_hash`` = engine hash, ``tokens_hash`` = ``compute_block_hash_for_seq`` of the block),
  then one ``find_matches`` as a barrier so the timed span covers the tree thread's work.
Both sides parse their own wire form inside the timed loop; the bytes are built beforehand.
Secondary shapes of ours (``inproc_ours_legacy_*``, ``inproc_ours_chain_*``): pre-built index
objects, one legacy ``Prefix`` per block and one ``apply_event`` per removed block (what the
server did before the compact parser and batched evictions), and stored blocks as one chain
entry.

Lookups, the same queries, each call timed alone:
- **ours (headline)**: ``Router.lookup`` with a packed chain (the full LookupRoute pipeline:
  policy, gates, scoring, ranking; G1/G2 floors and affinity off so every holder is returned);
- **ours raw**: the partition store's ``walk`` alone (the matching step);
- **Dynamo**: ``find_matches(tokens_hashes).scores``.

Correctness: the oracle (per-worker sets of cached block ids → leading run per worker) answers
every query; every timed answer of both sides is compared with it, and an untimed pass also
checks ``verify_queries`` queries at several checkpoints during ingest. Any mismatch fails the
run. Rounds interleave the sides (ABBA), and the ratios reported are medians of per-round ratios
(``*_speedup_vs_dynamo`` = our throughput / theirs).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import gc
import json
import pickle
import tempfile
import time
from typing import Any

from bench import common
from bench.workload import (
    FULL,
    QUICK,
    REMOVED,
    SMOKE,
    STORED,
    Answer,
    Oracle,
    Params,
    Workload,
    compare,
    generate,
)
from inferencecache.procs import Children, child_env

TENANT, MODEL, SCHEME = "bench", "bench-model", "vllm"
PLACEMENTS = ("split", "shared")  # where Dynamo's threads run (peer_dynamo.py "mode")
DYNAMO_MODES = ("fast", "slow")  # per round and figure: the better and the worse placement


# ---------------------------------------------------------------------------------------------
# Our side (runs in a worker process: `python bench/vs_dynamo.py --worker`)


class Ours:
    """The index side of the line protocol (commands as in ``bench/peer_dynamo.py``)."""

    def __init__(self, store: str) -> None:
        from inferencecache.index.backends import store_factory

        self.store_name = store
        self.factory = store_factory(None if store == "default" else store)
        self.calls: list[tuple[int, Any]] = []
        self.chain_calls: list[tuple[int, Any]] = []
        self.wire_calls: list[tuple[int, Any]] = []
        self.requests: list[Any] = []
        self.walks: list[tuple[bytes, list[int]]] = []
        self.verify_requests: list[Any] = []
        self.checkpoints: list[int] = []
        self.block_size = 16
        self.index: Any = None
        self.router: Any = None

    def _fresh(self) -> tuple[Any, Any]:
        from inferencecache.index import Index, IndexConfig, IndexSettings, Router, TenantPolicy

        policy = TenantPolicy(minimum_matched_tokens=0, routing_floor_score=0.0,
                              affinity_routing=False)
        index = Index(
            IndexSettings(max_holds=0, engine_block_size=self.block_size),
            store_factory=self.factory,
            config=IndexConfig(policies={TENANT: policy}),
        )
        return index, Router(index)

    def load(self, path: str) -> dict[str, Any]:
        from inferencecache import fingerprint
        from inferencecache.index import Event, EventType, LookupRequest, Prefix, Update
        from inferencecache.updatewire import encode_entries, encode_header
        from inferencecache.v1alpha1 import inferencecache_pb2 as pb

        with open(path, "rb") as f:
            wl: dict[str, Any] = pickle.load(f)
        bs: int = wl["block_size"]
        self.block_size = bs
        parent: list[int] = wl["block_parent"]
        tokens: list[list[int]] = wl["block_tokens"]
        fp: list[bytes] = []
        depth: list[int] = []
        for b, toks in enumerate(tokens):
            p = parent[b]
            base = int.from_bytes(fp[p], "big") if p >= 0 else None
            fp.append(fingerprint.chain_packed(toks, bs, base))
            depth.append(1 if p < 0 else depth[p] + 1)
        calls: list[tuple[int, Any]] = []
        chain_calls: list[tuple[int, Any]] = []
        wire_calls: list[tuple[int, Any]] = []
        for worker, kind, ids in wl["events"]:
            rid = f"w{worker}"
            if kind == STORED:
                # the subscriber's message: header + one T1 legacy entry per block
                wire_calls.append((2, encode_header(rid, MODEL, TENANT, SCHEME, 0) + encode_entries(
                    [(fp[b], depth[b] * bs, "", 1) for b in ids])))
            elif kind == REMOVED:
                wire_calls.append((3, pb.CacheEvent(
                    type=pb.CacheEvent.PREFIX_EVICTED, replica_id=rid, model_id=MODEL,
                    tenant_id=TENANT, prefix_hash=fp[ids[0]],
                    prefix_hashes=[fp[b] for b in ids[1:]]).SerializeToString()))
            else:
                wire_calls.append((3, pb.CacheEvent(
                    type=pb.CacheEvent.ALL_CLEARED, replica_id=rid, model_id=MODEL,
                    tenant_id=TENANT).SerializeToString()))
            if kind == STORED:
                prefixes = [Prefix(prefix_hash=fp[b], token_count=depth[b] * bs) for b in ids]
                calls.append((0, Update(replica_id=rid, model_id=MODEL, tenant_id=TENANT,
                                        hash_scheme=SCHEME, prefixes=prefixes)))
                # the same blocks as one chain PrefixEntry (what a batched subscriber could send)
                entry = Prefix(block_hashes=[fp[b] for b in ids],
                               block_token_counts=[bs] * len(ids))
                chain_calls.append((0, Update(replica_id=rid, model_id=MODEL, tenant_id=TENANT,
                                              hash_scheme=SCHEME, prefixes=[entry])))
                continue
            if kind == REMOVED:
                call = (1, [Event(type=EventType.PREFIX_EVICTED, replica_id=rid, model_id=MODEL,
                                  tenant_id=TENANT, prefix_hash=fp[b]) for b in ids])
            else:
                call = (1, [Event(type=EventType.ALL_CLEARED, replica_id=rid, model_id=MODEL,
                                  tenant_id=TENANT)])
            calls.append(call)
            chain_calls.append(call)
        self.calls = calls
        self.chain_calls = chain_calls
        self.wire_calls = wire_calls
        self.requests = []
        self.walks = []
        for q in wl["queries"]:
            packed = b"".join(fp[b] for b in q)
            counts = [bs] * len(q)
            self.requests.append(LookupRequest(
                tenant_id=TENANT, model_id=MODEL, hash_scheme=SCHEME, block_hashes=packed,
                packed_hashes=True, block_token_counts=counts))
            self.walks.append((packed, counts))
        self.verify_requests = self.requests[: wl["verify_queries"]]
        self.checkpoints = list(wl["checkpoints"])
        gc.collect()
        gc.freeze()
        store = type(self._fresh()[0].store_factory()).__name__
        return {"events": len(calls), "queries": len(self.requests), "store": store}

    def _apply(self, index: Any, calls: list[tuple[int, Any]]) -> None:
        from inferencecache.server.report_request import parse_event_request, parse_update_request

        au = index.apply_update
        ae = index.apply_event
        ab = index.apply_batch
        for kind, obj in calls:
            if kind == 2:  # what the server does per ReportCacheState message
                msg = parse_update_request(obj)
                ab(msg) if type(msg) is bytes else au(msg)
            elif kind == 3:  # per PublishEvent message
                msg = parse_event_request(obj)
                ab(msg) if type(msg) is bytes else ae(msg)
            elif kind == 0:
                au(obj)
            else:
                for e in obj:
                    ae(e)

    def _answer(self, res: Any) -> dict[str, Any]:
        if res.reason_code != "PREFIX_MATCH":
            return {} if res.reason_code == "NO_HINT" else {"reason": res.reason_code}
        out: dict[str, Any] = {}
        for s in res.replica_scores:
            blocks, rest = divmod(s.matched_tokens, self.block_size)
            out[s.replica_id[1:]] = blocks if not rest else s.matched_tokens / self.block_size
        return out

    def ingest(self, shape: str = "wire") -> dict[str, Any]:
        self.index = self.router = None
        gc.collect()
        index, router = self._fresh()
        calls = {"chain": self.chain_calls, "legacy": self.calls}.get(shape, self.wire_calls)
        t0 = time.perf_counter_ns()
        self._apply(index, calls)
        t1 = time.perf_counter_ns()
        self.index, self.router = index, router
        return {"ns": t1 - t0}

    def lookup(self) -> dict[str, Any]:
        lk = self.router.lookup
        clock = time.perf_counter_ns
        lat: list[int] = []
        res: list[Any] = []
        for req in self.requests:
            t0 = clock()
            r = lk(req)
            t1 = clock()
            lat.append(t1 - t0)
            res.append(r)
        # the matching step alone: the partition store's walk
        index = self.index
        part = index.run_locked(lambda st: st.parts.get((TENANT, MODEL, SCHEME, "")))
        raw: list[int] = []
        if part is not None:
            walk = part.store.walk
            fresh_after = index.clock.now_us() - index.settings.default_ttl_us
            for packed, counts in self.walks:
                t0 = clock()
                walk(packed, counts, fresh_after)
                t1 = clock()
                raw.append(t1 - t0)
        return {"lat_ns": lat, "raw_ns": raw, "answers": [self._answer(r) for r in res]}

    def verify(self) -> dict[str, Any]:
        index, router = self._fresh()
        out: list[list[dict[str, Any]]] = []
        done = 0
        for cp in self.checkpoints:
            self._apply(index, self.wire_calls[done:cp])
            done = cp
            out.append([self._answer(router.lookup(r)) for r in self.verify_requests])
        problems = index.verify()
        return {"answers": out, "invariants": problems[:5]}


def _worker_main(store: str) -> int:
    from inferencecache.server.command import GC_THRESHOLD

    gc.set_threshold(*GC_THRESHOLD)  # as in `serve`, whose index this process stands for
    ours = Ours(store)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "load":
                common.worker_reply(ours.load(cmd["path"]))
            elif op == "ingest":
                common.worker_reply(ours.ingest(cmd.get("shape", "wire")))
            elif op == "lookup":
                common.worker_reply(ours.lookup())
            elif op == "verify":
                common.worker_reply(ours.verify())
            elif op == "quit":
                common.worker_reply({"ok": True})
                return 0
            else:
                common.worker_reply({"error": f"unknown op {op!r}"})
        except Exception as e:
            common.worker_reply({"error": f"{type(e).__name__}: {e}"})
    return 0


# ---------------------------------------------------------------------------------------------
# The driver


def _norm(ans: dict[str, Any]) -> Answer | dict[str, Any]:
    """Worker answers (JSON: str keys) → {worker: blocks}; anything odd stays visible."""
    try:
        return {int(k): v for k, v in ans.items()}
    except ValueError:
        return ans


def _check(side: str, got: list[dict[str, Any]], want: list[Answer]) -> list[str]:
    return compare(side, [_norm(a) for a in got], want)  # type: ignore[misc]


def _summary(lat_ns: list[int]) -> tuple[float, float, float]:
    """(p50 µs, p99 µs, calls/s) of one round's per-call latencies."""
    us = [x / 1000 for x in lat_ns]
    total = sum(us)
    return (common.percentile(us, 0.5), common.percentile(us, 0.99),
            len(us) / (total / 1e6) if total else float("nan"))


def run(quick: bool = False, *, smoke: bool = False, rounds: int | None = None,
        peer: bool = True, params: Params | None = None, store: str = "default") -> dict[str, Any]:
    """Run the comparison; returns the figures (keys ``lookup_speedup_vs_dynamo``,
    ``ingest_speedup_vs_dynamo``, ``inproc_*``). Raises ``AssertionError`` on a wrong answer;
    ``common.PeerUnavailable`` when the peer is wanted but cannot be installed."""
    p = params or (SMOKE if smoke else QUICK if quick else FULL)
    n_rounds = rounds if rounds is not None else (0 if smoke else 5 if quick else 9)
    common.log(f"vs_dynamo: generating workload (seed {p.seed}, {p.workers} workers)")
    wl: Workload = generate(p)
    st = wl.stats()
    oracle = Oracle(wl)
    want_cp: list[list[Answer]] = []
    vq = wl.queries[: p.verify_queries]
    for cp in wl.checkpoints:
        oracle.apply_until(cp)
        want_cp.append(oracle.answers(vq))
    oracle.apply_until(len(wl.events))
    want_final = oracle.answers(wl.queries)
    out: dict[str, Any] = {
        "inproc_workload": {**{k: round(v, 2) for k, v in st.items()},
                            "workers": p.workers, "block_size": p.block_size, "seed": p.seed},
        "inproc_rounds": n_rounds,
    }
    peer_py = common.ensure_peer_venv() if peer else None
    errors: list[str] = []
    with Children() as procs, tempfile.TemporaryDirectory(prefix="bench-vsd-") as tmp:
        path = Path(tmp) / "workload.pkl"
        with open(path, "wb") as f:
            pickle.dump(wl.to_plain(), f, protocol=pickle.HIGHEST_PROTOCOL)
        sides: dict[str, common.Worker] = {
            "ours": common.Worker(procs, [sys.executable, str(Path(__file__).resolve()),
                                          "--worker", "--store", store],
                                  "ours", env=child_env(), cwd=common.REPO)
        }
        if peer_py is not None:
            # one process per placement of Dynamo's threads (peer_dynamo.py "mode")
            for place in PLACEMENTS:
                sides[f"dynamo_{place}"] = w = common.Worker(
                    procs, [str(peer_py), str(common.BENCH_DIR / "peer_dynamo.py")],
                    f"dynamo-{place}", env=child_env({"DYN_LOG": "error"}), cwd=common.REPO)
                w.call({"op": "mode", "mode": place})
        for name, w in sides.items():
            rep = w.call({"op": "load", "path": str(path)})
            if name == "ours":
                out["inproc_ours_store"] = rep.get("store")
        # correctness pass (untimed): checkpoints during ingest
        for name, w in sides.items():
            rep = w.call({"op": "verify"})
            for i, got in enumerate(rep["answers"]):
                errors += _check(f"{name}@checkpoint{i}", got, want_cp[i])
            if rep.get("invariants"):
                errors.append(f"{name}: index invariants: {rep['invariants']}")
        out["inproc_checked_answers"] = len(vq) * len(wl.checkpoints) * len(sides)
        per: dict[str, dict[str, list[float]]] = {
            s: {k: [] for k in ("ingest", "ingest_blocks", "chain_ingest", "legacy_ingest",
                                "lookup", "p50", "p99", "raw", "raw_p50", "raw_p99")}
            for s in sides}
        blocks = st["stored_blocks"] + st["removed_blocks"]
        order = list(sides)
        for r in range(n_rounds):
            common.log(f"vs_dynamo: round {r + 1}/{n_rounds}")
            for name in order if r % 2 == 0 else order[::-1]:
                w = sides[name]
                if name == "ours":  # secondary shapes: chain entries, pre-built legacy objects
                    for shape in ("chain", "legacy"):
                        secs = w.call({"op": "ingest", "shape": shape})["ns"] / 1e9
                        per[name][f"{shape}_ingest"].append(st["events"] / secs)
                        errors += _check(f"ours({shape} entries)",
                                         w.call({"op": "lookup"})["answers"], want_final)
                secs = w.call({"op": "ingest"})["ns"] / 1e9
                per[name]["ingest"].append(st["events"] / secs)
                per[name]["ingest_blocks"].append(blocks / secs)
                rep = w.call({"op": "lookup"})
                p50, p99, rate = _summary(rep["lat_ns"])
                per[name]["p50"].append(p50)
                per[name]["p99"].append(p99)
                per[name]["lookup"].append(rate)
                if rep.get("raw_ns"):
                    rp50, rp99, rrate = _summary(rep["raw_ns"])
                    per[name]["raw"].append(rrate)
                    per[name]["raw_p50"].append(rp50)
                    per[name]["raw_p99"].append(rp99)
                errors += _check(f"{name}@round{r + 1}", rep["answers"], want_final)
        out["inproc_checked_answers"] += n_rounds * len(wl.queries) * len(sides)
        for w in sides.values():
            w.close()
    out["inproc_correct"] = not errors
    out["inproc_errors"] = errors[:20]
    out["inproc_peer"] = (f"{common.DYNAMO_PACKAGE}=={common.DYNAMO_VERSION}"
                          if peer_py is not None else None)
    if n_rounds:
        for name, d in per.items():
            out[f"inproc_{name}_ingest_events_per_s"] = common.rounded(
                common.median(d["ingest"]), 0)
            out[f"inproc_{name}_ingest_blocks_per_s"] = common.rounded(
                common.median(d["ingest_blocks"]), 0)
            out[f"inproc_{name}_lookups_per_s"] = common.rounded(common.median(d["lookup"]), 0)
            out[f"inproc_{name}_lookup_p50_us"] = common.rounded(common.median(d["p50"]))
            out[f"inproc_{name}_lookup_p99_us"] = common.rounded(common.median(d["p99"]))
            for shape in ("chain", "legacy"):
                if d[f"{shape}_ingest"]:
                    out[f"inproc_{name}_{shape}_ingest_events_per_s"] = common.rounded(
                        common.median(d[f"{shape}_ingest"]), 0)
            if d["raw"]:
                out[f"inproc_{name}_walk_per_s"] = common.rounded(common.median(d["raw"]), 0)
                out[f"inproc_{name}_walk_p50_us"] = common.rounded(common.median(d["raw_p50"]))
                out[f"inproc_{name}_walk_p99_us"] = common.rounded(common.median(d["raw_p99"]))
        if "dynamo_split" in per:
            # Dynamo's fast and slow modes: per round, its better and worse placement of each
            # figure (throughputs: higher is better; latencies: lower)
            a, b = per["dynamo_split"], per["dynamo_shared"]
            for mode, pick in (("fast", max), ("slow", min)):
                per[f"dynamo_{mode}"] = {
                    k: [(pick(x, y) if k in ("ingest", "ingest_blocks", "lookup")
                         else (min(x, y) if pick is max else max(x, y)))
                        for x, y in zip(a[k], b[k], strict=True)]
                    for k in ("ingest", "ingest_blocks", "lookup", "p50", "p99")
                }
                for key, vals in per[f"dynamo_{mode}"].items():
                    name = {"ingest": "ingest_events_per_s", "ingest_blocks":
                            "ingest_blocks_per_s", "lookup": "lookups_per_s",
                            "p50": "lookup_p50_us", "p99": "lookup_p99_us"}[key]
                    out[f"inproc_dynamo_{mode}_{name}"] = common.rounded(
                        common.median(vals), 0 if "per_s" in name else 2)

            def ratio(a: list[float], b: list[float]) -> float | None:
                return common.rounded(common.median([x / y for x, y in zip(a, b, strict=True)]))

            def per_round(a: list[float], b: list[float]) -> list[float | None]:
                return [common.rounded(x / y) for x, y in zip(a, b, strict=True)]

            o = per["ours"]
            for mode in DYNAMO_MODES:
                t = per[f"dynamo_{mode}"]
                out[f"inproc_ingest_ratio_vs_dynamo_{mode}"] = ratio(o["ingest_blocks"],
                                                                      t["ingest_blocks"])
                out[f"inproc_lookup_ratio_vs_dynamo_{mode}"] = ratio(o["lookup"], t["lookup"])
            t = per["dynamo_fast"]  # the headline ratios: against Dynamo at its best
            out["lookup_speedup_vs_dynamo"] = ratio(o["lookup"], t["lookup"])
            out["ingest_speedup_vs_dynamo"] = ratio(o["ingest"], t["ingest"])
            out["ingest_chain_speedup_vs_dynamo"] = ratio(o["chain_ingest"], t["ingest"])
            out["ingest_legacy_speedup_vs_dynamo"] = ratio(o["legacy_ingest"], t["ingest"])
            out["lookup_raw_speedup_vs_dynamo"] = ratio(o["raw"], t["lookup"])
            out["inproc_lookup_p50_ratio_vs_dynamo"] = ratio(o["p50"], t["p50"])
            out["inproc_speedup_rounds"] = {
                f"{what}_{mode}": per_round(o[key], per[f"dynamo_{mode}"][key])
                for mode in DYNAMO_MODES
                for what, key in (("lookup", "lookup"), ("ingest", "ingest_blocks"))
            }
    if errors:
        raise AssertionError("vs_dynamo: wrong answers:\n" + "\n".join(errors[:20]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny, correctness only")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-peer", action="store_true", help="our side and the oracle only")
    ap.add_argument("--store", default="default", help="index store backend (default, native, "
                    "python)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker_main(args.store)
    with common.sigterm_as_exit():
        res = run(args.quick, smoke=args.smoke, rounds=args.rounds, peer=not args.no_peer,
                  store=args.store)
    common.print_figures(res, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
