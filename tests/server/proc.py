"""``inferencecache serve`` as a child process: start, read its JSON log, stop by PID."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

CLI = [sys.executable, "-m", "inferencecache.cli"]


def run_cli(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    input_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run one short-lived CLI invocation to completion (bounded)."""
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        input=input_text,
        check=False,
    )


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCECACHE_")}
    for keep in ("INFERENCECACHE_PURE_PYTHON", "INFERENCECACHE_REQUIRE_NATIVE"):
        if keep in os.environ:
            env[keep] = os.environ[keep]
    env.update(extra or {})
    return env


class ServeProcess:
    """A running ``serve``; stderr JSON lines are collected by a reader thread."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*CLI, "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(env),
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_log(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 30.0
    ) -> dict[str, Any]:
        """The first JSON log record matching ``pred`` (bounded wait)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"log line not seen within {timeout}s; got {self.seen!r}")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"process exited ({self.proc.poll()}); log: {self.seen!r}")
            self.seen.append(line)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and pred(rec):
                return rec

    def wait_serving(self, timeout: float = 30.0) -> dict[str, Any]:
        return self.wait_log(lambda r: r.get("msg") == "serving", timeout)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Teardown: SIGKILL by PID if still running, then reap (bounded)."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        finally:
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])
