"""Child processes of the demo: ``inferencecache <command>`` with its JSON logs read back.

Every child listens on port 0 and the demo reads the address it bound from its startup log, so
no port is guessed. A child is stopped by its own PID (SIGTERM, then SIGKILL after a bounded
wait), and :class:`Children` stops every child it started, newest first, whatever happened.
Children run in their own session, so a Ctrl-C in the terminal reaches the demo only and the
demo shuts them down in order.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import IO, Any


class ChildFailed(RuntimeError):
    """A child exited or did not log what was expected in time."""


class Child:
    """One ``python -m inferencecache.cli ...`` process."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.args = args
        full_env = {**os.environ, **(env or {})}
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "inferencecache.cli", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.records: list[dict[str, Any]] = []
        self.tail: deque[str] = deque(maxlen=20)
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(self.popen.stderr,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            rec: Any = None
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
            with self._cv:
                self.tail.append(line)
                if isinstance(rec, dict) and len(self.records) < 10_000:
                    self.records.append(rec)
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_log(self, msg: str, timeout: float) -> dict[str, Any]:
        """The first log record whose ``msg`` is ``msg``; ChildFailed on exit or timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for rec in self.records:
                    if rec.get("msg") == msg:
                        return rec
                left = deadline - time.monotonic()
                if left <= 0 or (not self.alive() and not self._reader.is_alive()):
                    state = "exited" if not self.alive() else "is still starting"
                    raise ChildFailed(
                        f"{self.name} (pid {self.pid}) {state}; no {msg!r} log within "
                        f"{timeout:.0f}s; last lines:\n  " + "\n  ".join(self.tail)
                    )
                self._cv.wait(min(left, 0.1))

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM by PID, SIGKILL after ``timeout``; returns the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(5)
        if self.popen.stderr is not None:
            with contextlib.suppress(Exception):
                self.popen.stderr.close()
        return self.popen.returncode


class Children:
    """Every child the demo started; ``stop_all`` stops them by PID, newest first."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.pids: list[int] = []

    def start(self, name: str, args: list[str]) -> Child:
        child = Child(name, args)
        self.children.append(child)
        self.pids.append(child.pid)
        return child

    def stop(self, child: Child) -> None:
        child.stop()
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        # SIGTERM everyone first (they shut down in parallel), then wait for each.
        for child in reversed(self.children):
            if child.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
