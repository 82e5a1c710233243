"""Child processes of ``inferencecache`` itself, for the demo, the tests and the benchmarks.

A :class:`Child` is ``python -m inferencecache.cli <args>``; a thread reads its stderr JSON log
lines back, so a caller waits for ``serving`` (or any record) and reads the address it bound:
children listen on port 0 and no port is guessed. Every process is stopped by its own PID
(SIGTERM, a bounded wait, SIGKILL, another bounded wait), and :class:`Children` stops every
process it started, newest first, whatever happened (an error, Ctrl-C, SIGTERM turned into
SystemExit). Nothing here signals by name or by process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, Any, Final

CLI: Final = (sys.executable, "-m", "inferencecache.cli")
"""How a child runs the console script (the same interpreter, no PATH lookup)."""

KEEP_ENV: Final = (
    "INFERENCECACHE_PURE_PYTHON",  # which accelerator build the children use ...
    "INFERENCECACHE_REQUIRE_NATIVE",  # ... and whether a missing build is an error
    "INFERENCECACHE_TEST_MARKER",  # lets a test find every process a run started (/proc)
)
"""``INFERENCECACHE_*`` variables :func:`child_env` passes on; every other one is a setting."""

KILL_WAIT_S: Final = 5.0
"""How long to wait for a process to go after SIGKILL."""
READER_WAIT_S: Final = 2.0
"""How long a stopped child's last log lines may take to be read (a grandchild may hold the
pipe open; the pipe is closed after this either way)."""

Matcher = str | Callable[[dict[str, Any]], bool] | None


class ChildFailed(RuntimeError):
    """A child exited, or did not log what was expected in time."""


def child_env(
    extra: Mapping[str, str] | None = None, *, keep: Iterable[str] = KEEP_ENV
) -> dict[str, str]:
    """This process's environment without its ``INFERENCECACHE_*`` settings (but ``keep``),
    plus ``extra``: a child's flags and settings are then exactly what the caller passes."""
    kept = set(keep)
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("INFERENCECACHE_") or k in kept
    }  # fmt: skip
    env.update(extra or {})
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host``, for a peer that cannot bind port 0 itself."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_cli(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """Run one short-lived ``inferencecache <args>`` to completion (bounded), output captured;
    the environment is :func:`child_env` of ``env``."""
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=child_env(env),
        check=False,
    )  # fmt: skip


def stop_process(
    popen: subprocess.Popen[Any], timeout: float = 8.0, readers: Iterable[threading.Thread] = ()
) -> int | None:
    """SIGTERM ``popen`` by its PID, SIGKILL it after ``timeout``, wait for it (bounded), let
    ``readers`` of its pipes reach the end (bounded), close the pipes; returns the exit code
    (None if it outlived even SIGKILL's wait)."""
    if popen.poll() is None:
        signal_process(popen, signal.SIGTERM)
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_process(popen)
    for reader in readers:
        reader.join(READER_WAIT_S)
    for stream in (popen.stdin, popen.stdout, popen.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
    return popen.returncode


def signal_process(popen: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to ``popen``'s PID while it has not been reaped (so never to a reused PID)."""
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(popen.pid, sig)


def kill_process(popen: subprocess.Popen[Any]) -> None:
    """SIGKILL ``popen`` by its PID (a crash) and reap it, bounded."""
    signal_process(popen, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(KILL_WAIT_S)


def _matches(rec: dict[str, Any], msg: Matcher, attrs: Mapping[str, Any]) -> bool:
    if callable(msg):
        if not msg(rec):
            return False
    elif msg is not None and not str(rec.get("msg", "")).startswith(msg):
        return False
    return all(rec.get(k) == v for k, v in attrs.items())


class Child:
    """One running ``python -m inferencecache.cli <args>``; its JSON log records are collected.

    ``env`` overrides variables of the inherited environment; with ``inherit=False`` the
    caller's ``INFERENCECACHE_*`` settings are left out first (:func:`child_env`).
    ``new_session`` puts the child in a session of its own, so a Ctrl-C in the terminal reaches
    the parent only and the parent shuts its children down in order. The last ``max_records``
    log records and ``max_lines`` stderr lines are kept (a long demo must not grow without end).
    """

    def __init__(
        self,
        *args: str,
        name: str = "",
        env: Mapping[str, str] | None = None,
        inherit: bool = True,
        stdin: bool = False,
        new_session: bool = False,
        max_records: int = 10_000,
        max_lines: int = 200,
    ) -> None:
        self.args = list(args)
        self.name = name or (args[0] if args else "inferencecache")
        full_env = {**os.environ, **(env or {})} if inherit else child_env(env)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.popen = subprocess.Popen(
            [*CLI, *args],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=new_session,
        )
        self.pid = self.popen.pid
        self.records: list[dict[str, Any]] = []
        self._max_records = max_records
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(self.popen.stderr,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        with contextlib.suppress(OSError, ValueError):  # the pipe closed under us by stop()
            for raw in stream:
                line = raw.decode(errors="replace").rstrip("\n")
                rec: Any = None
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                with self._cv:
                    self._lines.append(line)
                    if isinstance(rec, dict):
                        self.records.append(rec)
                        if len(self.records) > self._max_records:
                            del self.records[0]
                    self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def tail(self, n: int = 20) -> list[str]:
        """The last ``n`` stderr lines (for error messages)."""
        with self._cv:
            return list(self._lines)[-n:]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_log(self, msg: Matcher = None, timeout: float = 30.0, **attrs: Any) -> dict[str, Any]:
        """The first log record whose ``msg`` starts with ``msg`` (or for which ``msg(record)``
        is true) and whose attributes equal ``attrs``; ChildFailed on exit or timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for rec in self.records:
                    if _matches(rec, msg, attrs):
                        return rec
                left = deadline - time.monotonic()
                if left <= 0 or (not self.alive() and not self._reader.is_alive()):
                    state = "is still running" if self.alive() else (
                        f"exited with {self.popen.returncode}")
                    want = getattr(msg, "__name__", msg) if callable(msg) else repr(msg)
                    raise ChildFailed(
                        f"{self.name} (pid {self.pid}) {state}; no log {want} {attrs or ''} "
                        f"within {timeout:.0f}s; last lines:\n  " + "\n  ".join(self._lines)
                    )
                self._cv.wait(min(left, 0.1))

    def count(self, msg: Matcher = None, **attrs: Any) -> int:
        """How many log records so far match (as in :meth:`wait_log`)."""
        with self._cv:
            return sum(1 for r in self.records if _matches(r, msg, attrs))

    def send(self, line: str) -> None:
        """Write one line to the child's stdin (``stdin=True``)."""
        assert self.popen.stdin is not None
        self.popen.stdin.write((line.rstrip("\n") + "\n").encode())
        self.popen.stdin.flush()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to this child's PID (while it runs)."""
        signal_process(self.popen, sig)

    def wait(self, timeout: float = 30.0) -> int:
        """The exit code (TimeoutExpired after ``timeout``)."""
        return self.popen.wait(timeout)

    def stop(self, timeout: float = 8.0) -> int | None:
        """SIGTERM by PID, SIGKILL after ``timeout``; returns the exit code. Every log line the
        child wrote is read before this returns."""
        return stop_process(self.popen, timeout, (self._reader,))

    def kill(self) -> None:
        """SIGKILL by PID (a crash)."""
        kill_process(self.popen)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Children:
    """Every process a caller started; :meth:`stop_all` (and leaving a ``with`` block) stops
    them by PID, newest first.

    ``together`` sends SIGTERM to every live one first, so they shut down in parallel (the demo,
    where waiting for each in turn only adds time); otherwise each is stopped before the next,
    so a process is gone before what it talks to (a subscriber before its server).
    """

    def __init__(self, *, stop_timeout: float = 8.0, together: bool = False) -> None:
        self.stop_timeout = stop_timeout
        self.together = together
        self._procs: list[Child | subprocess.Popen[Any]] = []

    def start(self, *args: str, **kw: Any) -> Child:
        """A :class:`Child` (``kw`` as there), stopped with the others."""
        child = Child(*args, **kw)
        self._procs.append(child)
        return child

    def popen(self, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Any other command (``kw`` go to ``subprocess.Popen``), stopped with the others."""
        p: subprocess.Popen[Any] = subprocess.Popen(list(cmd), **kw)
        self._procs.append(p)
        return p

    def stop(self, proc: Child | subprocess.Popen[Any]) -> int | None:
        """Stop one of them now (bounded); returns its exit code."""
        try:
            if isinstance(proc, Child):
                return proc.stop(self.stop_timeout)
            return stop_process(proc, self.stop_timeout)
        finally:
            if proc in self._procs:
                self._procs.remove(proc)

    def stop_all(self) -> None:
        """Stop every one still listed, newest first; an error stopping one does not keep the
        others running (the first is raised at the end)."""
        procs = list(reversed(self._procs))
        if self.together:
            for p in procs:
                signal_process(p.popen if isinstance(p, Child) else p, signal.SIGTERM)
        errors: list[BaseException] = []
        for p in procs:
            try:
                self.stop(p)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


class RedisServer:
    """A private ``redis-server`` on 127.0.0.1 (tests and benchmarks of the event log).

    Append-only persistence in ``directory`` (so ``restart()`` keeps the stream), no RDB
    snapshots; stopped by its own PID. ``appendonly=False`` models a Redis that comes back
    empty."""

    def __init__(
        self,
        directory: str,
        *,
        port: int = 0,
        appendonly: bool = True,
        password: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = password
        self.extra_args = list(extra_args)  # e.g. --tls-port and its files
        self.popen: subprocess.Popen[Any] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise ChildFailed("redis-server is not installed (apt-get install -y redis-server)")
        self.popen = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--dir", self.directory,
             "--protected-mode", "no", "--loglevel", "warning",
             *(["--requirepass", self.password] if self.password else []),
             *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH"):
                        return self
            except OSError:
                pass
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ChildFailed(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Redis flushes its append-only file and exits), SIGKILL after ``timeout``."""
        if self.popen is not None:
            stop_process(self.popen, timeout)
            self.popen = None

    def kill(self) -> None:
        if self.popen is not None:
            kill_process(self.popen)
            self.popen.wait(10)
            self.popen = None

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
