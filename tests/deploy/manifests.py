"""Render the Kustomize trees under deploy/ and read what the containers would run.

``kubectl kustomize`` (the client only; no API server) renders; ``container_settings`` resolves a
container's ``$(VAR)`` arguments from its environment (fieldRefs, ConfigMaps of the same render)
and parses them with the real ``inferencecache`` command, so a manifest cannot use a flag that
does not exist or a value the binary would refuse.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUSTOMIZATIONS = ("base", "overlays/example", "overlays/event-log", "overlays/tls", "observability",
                  "doctor")
INFERENCECACHE_IMAGE = re.compile(r"(^|/)inferencecache(:|@|$)")
FIELD_VALUES = {"metadata.name": "vllm-0", "metadata.namespace": "inferencecache"}

Obj = dict[str, Any]


def render(path: str) -> list[Obj]:
    res = subprocess.run(["kubectl", "kustomize", str(DEPLOY / path)], capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert res.returncode == 0, f"kubectl kustomize {path} failed: {res.stderr}"
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise AssertionError(f"no {kind}/{name} in the render")


def containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, container) of every Deployment/StatefulSet/Job container."""
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in o["spec"]["template"]["spec"]["containers"]:
                yield o, c


def is_ours(container: Obj) -> bool:
    return bool(INFERENCECACHE_IMAGE.search(container["image"].split("/")[-1]))


def environment(objs: list[Obj], container: Obj) -> dict[str, str]:
    """The container's environment as Kubernetes builds it (envFrom, then env)."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        cm = find(objs, "ConfigMap", src["configMapRef"]["name"])
        env.update({k: str(v) for k, v in cm["data"].items()})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = str(find(objs, "ConfigMap", ref["name"])["data"][ref["key"]])
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion in command arguments (unknown names stay as written)."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a)
            for a in args]  # fmt: skip


def container_settings(objs: list[Obj], container: Obj, monkeypatch: Any) -> tuple[str, Any]:
    """(subcommand, its settings object) as the container's ``inferencecache`` would build it."""
    from inferencecache.cli import group

    env = environment(objs, container)
    args = expand(container["args"], env)
    for key in [k for k in __import__("os").environ if k.startswith("INFERENCECACHE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    sub = args[0]
    ctx = click.Context(group)
    cmd = group.get_command(ctx, sub)
    assert cmd is not None, f"no subcommand {sub!r}"
    try:
        parsed = cmd.make_context(sub, list(args[1:]))
    except click.UsageError as e:
        raise AssertionError(f"{container['name']}: `inferencecache {' '.join(args)}`: {e}") from e
    settings_cls = SETTINGS[sub]()
    return sub, settings_cls(**parsed.params)


def _serve() -> type:
    from inferencecache.server.settings import ServeSettings

    return ServeSettings


def _subscribe() -> type:
    from inferencecache.subscriber.settings import SubscribeSettings

    return SubscribeSettings


def _gateway() -> type:
    from inferencecache.gateway.settings import GatewaySettings

    return GatewaySettings


def _doctor() -> type:
    from inferencecache.doctor.settings import DoctorSettings

    return DoctorSettings


SETTINGS = {"serve": _serve, "subscribe": _subscribe, "gateway": _gateway, "doctor": _doctor}


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` in an argument list."""
    for i, a in enumerate(args):
        if a.startswith(f"{name}="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
