"""Shared plumbing of the benchmarks: the peer virtual environment, the line protocol of worker
processes, statistics. Child processes, free ports and the children's environment come from
``inferencecache.procs``, shared with the demo and the tests."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import math
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

from inferencecache.procs import Children

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
PEER_VENV = BENCH_DIR / ".venv-peers"
DYNAMO_PACKAGE = "ai-dynamo-runtime"
DYNAMO_VERSION = "1.6.1"
MARK = "@@BENCH "


def log(msg: str) -> None:
    """Progress on stderr (stdout stays free for tables and --json -)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The peer virtual environment


class PeerUnavailable(RuntimeError):
    """The Dynamo peer could not be installed (PyPI unreachable, no venv module, ...)."""


def peer_python() -> Path:
    return PEER_VENV / "bin" / "python"


def _peer_ok(py: Path) -> bool:
    if not py.exists():
        return False
    probe = (
        "import importlib.metadata as m, dynamo.llm; "
        f"print(m.version({DYNAMO_PACKAGE!r}))"
    )
    try:
        out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == DYNAMO_VERSION


def ensure_peer_venv() -> Path:
    """``bench/.venv-peers`` with ``ai-dynamo-runtime`` pinned; created on first use, cached.

    Never touches the project's own venv. A file lock makes concurrent callers (a test run and
    a benchmark) wait for one installation instead of racing.
    """
    py = peer_python()
    if _peer_ok(py):
        return py
    PEER_VENV.mkdir(parents=True, exist_ok=True)
    with open(PEER_VENV / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _peer_ok(py):
            return py
        log(f"installing {DYNAMO_PACKAGE}=={DYNAMO_VERSION} into {PEER_VENV} (once, ~75 MB)")
        base = getattr(sys, "_base_executable", sys.executable)
        steps = [
            [base, "-m", "venv", str(PEER_VENV)],
            [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             f"{DYNAMO_PACKAGE}=={DYNAMO_VERSION}"],
        ]
        for cmd in steps:
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise PeerUnavailable(f"{' '.join(cmd[:4])}…: {e}") from None
            if res.returncode != 0:
                tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
                raise PeerUnavailable(f"{' '.join(cmd[:4])}… failed: {' | '.join(tail)}")
        if not _peer_ok(py):
            raise PeerUnavailable(f"{DYNAMO_PACKAGE}=={DYNAMO_VERSION}: installed, not importable")
    return py


# ---------------------------------------------------------------------------------------------
# Child processes


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so ``finally`` blocks stop the children (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class Worker:
    """A child speaking the line protocol: one JSON command per line on stdin, one
    ``@@BENCH <json>`` reply line on stdout (other stdout lines are kept for diagnostics)."""

    def __init__(self, procs: Children, cmd: Sequence[str], name: str,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.procs = procs
        self.proc = procs.popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, env=env, cwd=cwd,
        )
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.other: collections.deque[str] = collections.deque(maxlen=40)
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        try:
            for line in stream:
                if line.startswith(MARK):
                    self.replies.put(json.loads(line[len(MARK):]))
                else:
                    self.other.append(line.rstrip())
        except (OSError, ValueError):
            pass
        self.replies.put(None)

    def call(self, cmd: dict[str, Any], timeout: float = 900.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise RuntimeError(f"{self.name} worker died: {self.tail()}") from None
        try:
            rep = self.replies.get(timeout=timeout)
        except queue.Empty:
            msg = f"{self.name} worker: no reply to {cmd['op']} in {timeout}s"
            raise RuntimeError(msg) from None
        if rep is None:
            raise RuntimeError(f"{self.name} worker exited: {self.tail()}")
        if "error" in rep:
            raise RuntimeError(f"{self.name} worker: {rep['error']}")
        return rep

    def tail(self) -> str:
        return " | ".join(list(self.other)[-8:])

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError):
                self.call({"op": "quit"}, timeout=10)
        self.procs.stop(self.proc)


def print_figures(res: dict[str, Any], *, as_json: bool) -> None:
    """A section's figures on stdout, as JSON or one ``name value`` line each."""
    if as_json:
        print(json.dumps(res, indent=2))
        return
    for k, v in res.items():
        print(f"{k:45s} {v}")


def worker_reply(obj: Any) -> None:
    """The worker side of the protocol."""
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return float(s[k])


def median(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return float(statistics.median(vals)) if vals else math.nan


def rounded(x: float, digits: int = 2) -> float | None:
    """JSON-friendly: NaN/inf become None."""
    if x is None or math.isnan(x) or math.isinf(x):
        return None
    return round(x, digits)
