"""Child processes for tests: ``inferencecache <command>`` with JSON-log capture, stopped by
PID with bounded waits (used by the engine and e2e tests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any


class Proc:
    """One ``python -m inferencecache.cli ...`` process; stderr JSON lines are collected."""

    def __init__(self, *args: str, stdin: bool = False, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        full_env = {**os.environ, **(env or {})}
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "inferencecache.cli", *args],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
        )
        self.pid = self.popen.pid
        self.lines: list[str] = []
        self.records: list[dict[str, Any]] = []
        self.out: list[str] = []
        self._cv = threading.Condition()
        self._threads = [
            threading.Thread(target=self._read, args=(self.popen.stderr, True), daemon=True),
            threading.Thread(target=self._read, args=(self.popen.stdout, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream: IO[bytes] | None, is_err: bool) -> None:
        assert stream is not None
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._cv:
                if is_err:
                    self.lines.append(line)
                    with contextlib.suppress(ValueError):
                        obj = json.loads(line)
                        if isinstance(obj, dict):
                            self.records.append(obj)
                else:
                    self.out.append(line)
                self._cv.notify_all()

    def wait_log(self, msg: str | None = None, timeout: float = 10.0,
                 **attrs: Any) -> dict[str, Any]:
        """The first JSON log record with this ``msg`` (prefix) and attributes."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for rec in self.records:
                    if msg is not None and not str(rec.get("msg", "")).startswith(msg):
                        continue
                    if all(rec.get(k) == v for k, v in attrs.items()):
                        return rec
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.popen.poll() is not None and not self._alive()):
                    raise AssertionError(
                        f"no log {msg!r} {attrs} from {self.args[:1]} within {timeout}s; "
                        f"exit={self.popen.poll()} stderr tail:\n" + "\n".join(self.lines[-15:]))
                self._cv.wait(min(remaining, 0.1))

    def _alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def count(self, msg: str, **attrs: Any) -> int:
        with self._cv:
            return sum(1 for r in self.records if str(r.get("msg", "")).startswith(msg)
                       and all(r.get(k) == v for k, v in attrs.items()))

    def send(self, line: str) -> None:
        """Write one line to the process's stdin."""
        assert self.popen.stdin is not None
        self.popen.stdin.write((line.rstrip("\n") + "\n").encode())
        self.popen.stdin.flush()

    def wait(self, timeout: float = 10.0) -> int:
        return self.popen.wait(timeout)

    def stop(self, timeout: float = 8.0) -> int | None:
        """SIGTERM this process (by its PID), then SIGKILL after ``timeout``."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(5)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL (a crash), by PID."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(5)

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_cli(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run ``inferencecache <args>`` to completion (flag checks, --help)."""
    return subprocess.run(
        [sys.executable, "-m", "inferencecache.cli", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )
