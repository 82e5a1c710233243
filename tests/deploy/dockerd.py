"""A private ``dockerd`` for the image tests, and the base image they build with ``debootstrap``.

No container registry is reachable here, so the base image (Debian minbase + python3 +
python3-venv, the host's release, from the mirror apt already uses) is made with ``debootstrap``
and ``docker import``; its tarball is cached under ``~/.cache/inferencecache/docker-base`` so only
the first run pays (~90 s). The daemon gets its own data root, exec root, pidfile and unix
socket under a short temp dir, no bridge and no iptables rules: containers run with
``--network host`` and everything stays on 127.0.0.1. Every container a test made is removed,
then the daemon is stopped by its PID (and its managed containerd by its own PID, should the
daemon die first), and its private data root, which holds every image the tests made, is
deleted (faster than ``docker rmi``, ~9 s per image here).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from inferencecache.procs import stop_process

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inferencecache"
BASE_PACKAGES = ("python3", "python3-venv")
# Trimmed like the official slim images: no package lists, no docs, man pages or locales.
STRIP = ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
         "usr/share/locale", "usr/share/info")


class DockerError(RuntimeError):
    pass


def host_codename() -> str:
    text = Path("/etc/os-release").read_text()
    m = re.search(r"^VERSION_CODENAME=\"?([a-z]+)", text, re.M)
    if m is None:
        raise DockerError("cannot read VERSION_CODENAME from /etc/os-release")
    return m.group(1)


def apt_mirror(suite: str) -> str:
    """The Debian mirror apt is configured with for ``suite`` (deb822 ``.sources`` files first,
    then one-line ``sources.list`` entries)."""
    root = Path("/etc/apt")
    for path in sorted((root / "sources.list.d").glob("*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
            if "deb" in fields.get("types", "").split() and suite in fields.get(
                "suites", ""
            ).split():
                return fields["uris"].split()[0]
    lists = [root / "sources.list", *sorted((root / "sources.list.d").glob("*.list"))]
    for path in lists:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            parts = re.sub(r"\[[^]]*\]", "", line).split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == suite:
                return parts[1]
    raise DockerError(f"no apt source for {suite!r} in /etc/apt: cannot debootstrap a base image")


def base_tarball(suite: str | None = None) -> Path:
    """The cached rootfs tarball of the base image (built with debootstrap on first use)."""
    suite = suite or host_codename()
    key = hashlib.sha256(f"{suite} minbase {' '.join(BASE_PACKAGES)} {STRIP}".encode())
    out = CACHE / "docker-base" / f"{suite}-python3-{key.hexdigest()[:12]}.tar"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test run may be building it right now
        if out.exists():
            return out
        if os.geteuid() != 0:
            raise DockerError("debootstrap needs root to build the base image")
        work = Path(tempfile.mkdtemp(prefix="deboot-", dir=out.parent))
        try:
            root = work / "root"
            cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                   suite, str(root), apt_mirror(suite)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
            if res.returncode != 0:
                tail = (res.stdout + res.stderr)[-2000:]
                raise DockerError(f"debootstrap failed ({res.returncode}):\n{tail}")
            for rel in STRIP:
                target = root / rel
                if target.is_dir():
                    shutil.rmtree(target)
                    target.mkdir()
            tmp = work / "base.tar"
            subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(tmp), "."],
                           check=True, timeout=300)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def _children_of(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (dockerd's managed containerd), read from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class Dockerd:
    """One private daemon; :meth:`docker` runs the client against it."""

    def __init__(self) -> None:
        # Short: the unix sockets below it must fit in 108 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="icd-", dir="/tmp"))
        self.socket = self.dir / "docker.sock"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}
        self.env.pop("DOCKER_CONTEXT", None)
        self.containers: list[str] = []
        self._log = open(self.dir / "dockerd.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            ["dockerd", "--data-root", str(self.dir / "data"), "--exec-root",
             str(self.dir / "exec"), "--pidfile", str(self.dir / "dockerd.pid"),
             "--host", f"unix://{self.socket}", "--bridge=none", "--iptables=false",
             "--ip6tables=false", "--ip-masq=false"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        self._helpers: list[tuple[int, bytes]] = []

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DockerError(f"dockerd exited with {self.proc.returncode}:\n{self.log()}")
            res = self.docker("version", "--format", "{{.Server.Version}}", check=False)
            if res.returncode == 0:
                self._helpers = [(pid, _cmdline(pid)) for pid in _children_of(self.proc.pid)]
                return
            time.sleep(0.25)
        raise DockerError(f"dockerd not ready within {timeout:.0f}s:\n{self.log()}")

    def log(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "dockerd.log").read_text(errors="replace")[-n:]
        return ""

    def docker(
        self, *args: str, check: bool = True, timeout: float = 120.0, input: bytes | None = None
    ) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            ["docker", *args], env=self.env, capture_output=True, timeout=timeout,
            input=input, check=False,
        )
        out = subprocess.CompletedProcess(
            res.args, res.returncode, res.stdout.decode(errors="replace"),
            res.stderr.decode(errors="replace"),
        )
        if check and out.returncode != 0:
            raise DockerError(f"docker {' '.join(args)} failed ({out.returncode}): {out.stderr}")
        return out

    def import_tarball(self, tarball: Path, tag: str) -> str:
        with open(tarball, "rb") as f:
            res = subprocess.run(["docker", "import", "-", tag], env=self.env, stdin=f,
                                 capture_output=True, timeout=300, check=False)
        if res.returncode != 0:
            raise DockerError(f"docker import failed: {res.stderr.decode(errors='replace')}")
        return tag

    def run(self, *args: str, name: str) -> str:
        """``docker run -d --network host --name NAME ARGS``; removed by :meth:`stop`."""
        self.containers.append(name)
        self.docker("run", "-d", "--network", "host", "--name", name, *args)
        return name

    def logs(self, name: str) -> str:
        res = self.docker("logs", name, check=False)
        return res.stdout + res.stderr

    def wait_log(self, name: str, msg: str, timeout: float = 60.0) -> dict[str, Any]:
        """The first JSON log record of container ``name`` whose ``msg`` starts with ``msg``."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.logs(name).splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if isinstance(rec, dict) and str(rec.get("msg", "")).startswith(msg):
                        return rec
            state = self.docker("inspect", "-f", "{{.State.Status}}", name, check=False)
            if state.stdout.strip() not in ("running", "created") or time.monotonic() > deadline:
                raise DockerError(f"container {name} ({state.stdout.strip()}) never logged "
                                  f"{msg!r}:\n{self.logs(name)[-3000:]}")
            time.sleep(0.2)

    def image_size(self, image: str) -> int:
        return int(self.docker("image", "inspect", "-f", "{{.Size}}", image).stdout.strip())

    def inspect(self, image: str) -> dict[str, Any]:
        data = json.loads(self.docker("image", "inspect", image).stdout)
        assert isinstance(data, list) and data
        out: dict[str, Any] = data[0]
        return out

    def stop(self) -> None:
        """Remove the containers, stop the daemon by PID (then any helper it left) and delete
        its data root with every image in it."""
        try:
            if self.proc.poll() is None:
                for name in reversed(self.containers):
                    self.docker("rm", "-f", name, check=False, timeout=60)
        finally:
            stop_process(self.proc, timeout=20)
            for pid, cmdline in self._helpers:  # managed containerd, if dockerd died first
                if cmdline and _cmdline(pid) == cmdline:  # still that process, not a reused PID
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self._log.close()
            self._unmount()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _unmount(self) -> None:
        """dockerd leaves its ``exec/netns/default`` (and, after a crash, overlay) mounts."""
        prefix = str(self.dir) + "/"
        with open("/proc/self/mounts") as f:
            points = [line.split()[1] for line in f if line.split()[1].startswith(prefix)]
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30, check=False)


@contextlib.contextmanager
def private_dockerd() -> Iterator[Dockerd]:
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        raise DockerError("dockerd/docker not installed (scripts/check installs docker.io)")
    d = Dockerd()
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()


def build_image(d: Dockerd, repo: Path, tag: str, base: str, extra: Sequence[str] = ()) -> str:
    """``scripts/build-image`` against the private daemon (deleted with its data root)."""
    cache = CACHE / "image-wheels"
    res = subprocess.run(
        [str(repo / "scripts" / "build-image"), "-t", tag, "--base-image", base,
         "--wheel-cache", str(cache), *extra],
        env=d.env, capture_output=True, text=True, timeout=900, check=False,
    )
    if res.returncode != 0:
        raise DockerError(f"scripts/build-image failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return tag
