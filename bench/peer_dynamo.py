"""Dynamo's side of the benchmarks: runs *inside* ``bench/.venv-peers`` (``ai-dynamo-runtime``).

Standard library + ``dynamo`` only (never ``inferencecache``: the peer venv does not have it).
A line-oriented worker driven by ``bench/vs_dynamo.py`` and ``bench/vs_dynamo_service.py``:
one JSON command per line on stdin, one reply per command on stdout as ``@@BENCH <json>``
(Dynamo's Rust logging may write other lines to stdout; the driver skips them).

Commands:
- ``{"op": "hash", "block_size": B, "seqs": [[tok, ...], ...]}`` → ``compute_block_hash_for_seq``
  of each sequence (Dynamo's per-block "local" content hashes, u64).
- ``{"op": "load", "path": P}``: read the pickled ``Workload.to_plain()`` dict, compute
  every block's ``tokens_hash`` and pre-serialise every event as the JSON bytes
  ``RadixTree.apply_event`` takes, and every query as its list of ``tokens_hash`` values.
- ``{"op": "ingest"}``: a fresh ``RadixTree``; apply every event (timed), then one
  ``find_matches`` as a barrier (every call goes through the same channel to the tree's thread,
  in order, so when it returns every event has been applied).
- ``{"op": "lookup"}``: every query through ``find_matches(...).scores`` on the ingested tree,
  each call timed alone; returns the latencies (ns) and the answers.
- ``{"op": "verify"}``: a fresh tree fed event by event, answering the verification queries at
  each checkpoint (untimed).
- ``{"op": "mode", "mode": "split" | "shared" | "any"}``: where Dynamo's threads run. Its calls
  hand off to a Rust thread, and how fast that is depends on where the thread runs: ``split``
  puts the calling Python thread on CPU 0 and every other thread of this process on CPU 1,
  ``shared`` puts every thread on CPU 0, ``any`` pins nothing. On this VM one placement is
  several times faster than the other (which one can differ between machines: waking an idle
  vCPU is slow here), so the benchmark measures both and calls the better one per round
  Dynamo's fast mode, the worse one its slow mode.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import pickle
import sys
import threading
import time
from typing import Any

STORED, REMOVED, CLEARED = 0, 1, 2  # same values as bench.workload
MARK = "@@BENCH "


def _reply(obj: Any) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _answers(scores: dict[tuple[int, int], int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (worker, _rank), blocks in scores.items():
        if blocks:
            out[str(worker)] = out.get(str(worker), 0) + int(blocks)
    return out


class Peer:
    def __init__(self) -> None:
        llm = importlib.import_module("dynamo.llm")
        self.RadixTree = llm.RadixTree
        self.block_hash = llm.compute_block_hash_for_seq
        self.events: list[tuple[int, bytes]] = []
        self.queries: list[list[int]] = []
        self.verify_queries: list[list[int]] = []
        self.checkpoints: list[int] = []
        self.tree: Any = None
        self.mode = "any"

    def load(self, path: str) -> dict[str, Any]:
        with open(path, "rb") as f:
            wl: dict[str, Any] = pickle.load(f)
        bs: int = wl["block_size"]
        # One call over all blocks: compute_block_hash_for_seq hashes each block alone (it is
        # not chained), so concatenating every block's tokens gives every block's hash.
        flat = [t for toks in wl["block_tokens"] for t in toks]
        th: list[int] = list(self.block_hash(flat, bs))
        assert len(th) == len(wl["block_tokens"])
        eh: list[int] = wl["engine_hash"]
        parent: list[int] = wl["block_parent"]
        event_id = [0] * wl["workers"]
        events: list[tuple[int, bytes]] = []
        for worker, kind, ids in wl["events"]:
            event_id[worker] += 1
            if kind == STORED:
                p = parent[ids[0]]
                data: Any = {
                    "stored": {
                        "parent_hash": eh[p] if p >= 0 else None,
                        "blocks": [{"block_hash": eh[b], "tokens_hash": th[b]} for b in ids],
                    }
                }
            elif kind == REMOVED:
                data = {"removed": {"block_hashes": [eh[b] for b in ids]}}
            else:
                data = "cleared"
            events.append((worker, json.dumps({"event_id": event_id[worker], "data": data})
                           .encode()))
        self.events = events
        self.queries = [[th[b] for b in q] for q in wl["queries"]]
        self.verify_queries = self.queries[: wl["verify_queries"]]
        self.checkpoints = list(wl["checkpoints"])
        gc.collect()
        gc.freeze()
        return {"events": len(events), "queries": len(self.queries)}

    def ingest(self) -> dict[str, Any]:
        self.tree = None
        gc.collect()
        tree = self.RadixTree()
        set_mode(self.mode)  # the tree's thread is new: pin it too
        apply = tree.apply_event
        events = self.events
        probe = self.queries[0] if self.queries else [0]
        t0 = time.perf_counter_ns()
        for worker, payload in events:
            apply(worker, payload)
        tree.find_matches(probe)  # barrier: the tree's thread has applied everything
        t1 = time.perf_counter_ns()
        self.tree = tree
        return {"ns": t1 - t0}

    def lookup(self) -> dict[str, Any]:
        fm = self.tree.find_matches
        clock = time.perf_counter_ns
        lat: list[int] = []
        res: list[Any] = []
        for q in self.queries:
            t0 = clock()
            r = fm(q).scores
            t1 = clock()
            lat.append(t1 - t0)
            res.append(r)
        return {"lat_ns": lat, "answers": [_answers(r) for r in res]}

    def verify(self) -> dict[str, Any]:
        tree = self.RadixTree()
        out: list[list[dict[str, int]]] = []
        done = 0
        for cp in self.checkpoints:
            for worker, payload in self.events[done:cp]:
                tree.apply_event(worker, payload)
            done = cp
            out.append([_answers(tree.find_matches(q).scores) for q in self.verify_queries])
        return {"answers": out}


def set_mode(mode: str) -> dict[str, Any]:
    """Pin this process's threads for ``mode`` (see the module doc); returns what was done."""
    cpus = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
    me = threading.get_native_id()
    tids = [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]
    if mode == "any" or len(cpus) < 2:
        for t in tids:
            os.sched_setaffinity(t, cpus)
        return {"mode": "any" if mode == "any" else "unpinned (one cpu)", "threads": len(tids)}
    caller, other = {cpus[0]}, ({cpus[1]} if mode == "split" else {cpus[0]})
    for t in tids:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(t, caller if t == me else other)
    return {"mode": mode, "threads": len(tids)}


def main() -> int:
    peer = Peer()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "hash":
                bs = int(cmd["block_size"])
                _reply({"hashes": [list(peer.block_hash(s, bs)) for s in cmd["seqs"]]})
            elif op == "load":
                _reply(peer.load(cmd["path"]))
            elif op == "ingest":
                _reply(peer.ingest())
            elif op == "lookup":
                _reply(peer.lookup())
            elif op == "verify":
                _reply(peer.verify())
            elif op == "mode":
                peer.mode = str(cmd["mode"])
                _reply(set_mode(peer.mode))
            elif op == "version":
                meta = importlib.import_module("importlib.metadata")
                _reply({"version": meta.version("ai-dynamo-runtime")})
            elif op == "quit":
                _reply({"ok": True})
                return 0
            else:
                _reply({"error": f"unknown op {op!r}"})
        except Exception as e:  # report, keep the protocol in step
            _reply({"error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
