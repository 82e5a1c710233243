"""The Kustomize trees under deploy/: they render, every object validates, and the settings that
must agree between engine, subscriber, server and gateway are wired from one place.

Kubernetes' own kinds are validated offline by kubernetes-validate (strict: unknown fields fail)
for the oldest and the newest Kubernetes release this project states (docs/deploy.md); the
Prometheus Operator kinds by ``crd_schemas``. Container arguments are parsed by the real CLI.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.crd_schemas import SCHEMAS
from tests.deploy.manifests import (
    KUSTOMIZATIONS,
    Obj,
    container_settings,
    containers,
    environment,
    expand,
    find,
    flag,
    is_ours,
    labels_match,
    render,
)

K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


@pytest.fixture(scope="module")
def example() -> list[Obj]:
    return render("overlays/example")


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_rendered_object_validates_against_its_schema(path: str) -> None:
    objs = render(path)
    assert objs, f"{path} rendered nothing"
    for obj in objs:
        what = f"{path}: {obj['kind']}/{obj['metadata']['name']}"
        if obj["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
            try:
                jsonschema.validate(obj, SCHEMAS[obj["kind"]])
            except jsonschema.ValidationError as e:
                raise AssertionError(f"{what}: {e.message} at {list(e.absolute_path)}") from e
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise AssertionError(f"{what} (Kubernetes {version}): {e.message} at "
                                     f"{list(e.absolute_path)}") from e  # fmt: skip


def test_the_example_overlay_has_every_part(example: list[Obj]) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in example}
    for want in [("Deployment", "inferencecache-server"), ("Service", "inferencecache-server"),
                 ("PodDisruptionBudget", "inferencecache-server"),
                 ("NetworkPolicy", "inferencecache-server"),
                 ("Deployment", "inferencecache-gateway"), ("StatefulSet", "vllm"),
                 ("ConfigMap", "inferencecache-config"), ("Namespace", "inferencecache")]:
        assert want in kinds, want
    assert {o["metadata"].get("namespace") for o in example if o["kind"] != "Namespace"} == {
        "inferencecache"}


def test_every_container_command_parses_with_the_real_cli(
    example: list[Obj], monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = set()
    for _, c in containers(example):
        if is_ours(c):
            sub, _ = container_settings(example, c, monkeypatch)
            ran.add(sub)
    assert ran == {"serve", "subscribe", "gateway"}


def _settings(example: list[Obj], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for _, c in containers(example):
        if is_ours(c):
            sub, s = container_settings(example, c, monkeypatch)
            out[sub] = s
    return out


def test_block_size_hash_scheme_and_model_come_from_one_place(
    example: list[Obj], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _settings(example, monkeypatch)
    shared = find(example, "ConfigMap", "inferencecache-config")["data"]
    block = int(shared["INFERENCECACHE_BLOCK_SIZE"])
    assert s["serve"].block_size == s["subscribe"].block_size == s["gateway"].block_size == block
    assert s["subscribe"].hash_scheme == s["gateway"].hash_scheme == shared[
        "INFERENCECACHE_HASH_SCHEME"]
    vllm_sts = find(example, "StatefulSet", "vllm")
    engine = next(c for c in vllm_sts["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "vllm")  # fmt: skip
    args = expand(engine["args"], environment(example, engine))
    assert flag(args, "--block-size") == str(block)
    assert flag(args, "--served-model-name") == s["subscribe"].model_id
    assert "--enable-prefix-caching" in args
    # The subscriber's tenant is the engines' namespace, and so is the gateway's.
    assert s["subscribe"].tenant_id == s["gateway"].tenant_id == "inferencecache"


def test_kv_events_and_lora_names_agree_between_engine_and_sidecar(
    example: list[Obj], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    s = _settings(example, monkeypatch)["subscribe"]
    sts = find(example, "StatefulSet", "vllm")
    engine = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    args = expand(engine["args"], environment(example, engine))
    kv = json.loads(flag(args, "--kv-events-config") or "{}")
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    # vLLM binds wildcard endpoints; the sidecar connects to the same ports over loopback.
    for key, mine in (("endpoint", s.engine_endpoint), ("replay_endpoint", s.replay_endpoint)):
        assert kv[key].startswith("tcp://*:")
        assert mine == "tcp://127.0.0.1:" + kv[key].rsplit(":", 1)[1]
    assert flag(args, "--port") == "8000"
    assert s.engine_metrics_url == "http://127.0.0.1:8000/metrics"
    # --lora-modules in load order get vLLM ids 1, 2, ...: the subscriber's table names them so.
    modules = flag(args, "--lora-modules")
    assert modules is not None
    names = [item.split("=", 1)[0] for item in modules.split()]
    assert s.adapter_names == {i: n for i, n in enumerate(names, 1)}
    assert "--enable-lora" in args


def test_gateway_engines_are_the_statefulset_pods_and_everyone_finds_the_server(
    example: list[Obj], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _settings(example, monkeypatch)
    sts = find(example, "StatefulSet", "vllm")
    headless = find(example, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    port = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "http")
    want = [(f"vllm-{i}", f"http://vllm-{i}.{headless['metadata']['name']}:{port}")
            for i in range(sts["spec"]["replicas"])]  # fmt: skip
    assert [(e.replica_id, e.url) for e in s["gateway"].engine_specs] == want
    svc = find(example, "Service", "inferencecache-server")
    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    for who in ("subscribe", "gateway"):
        assert str(s[who].server) == f"inferencecache-server:{grpc_port}", who
    assert s["serve"].grpc_address.port == grpc_port


def test_network_policies_admit_exactly_the_pods_that_need_each_port(example: list[Obj]) -> None:
    def pod_labels(kind: str, name: str) -> dict[str, str]:
        return dict(find(example, kind, name)["spec"]["template"]["metadata"]["labels"])

    engine, gateway = pod_labels("StatefulSet", "vllm"), pod_labels(
        "Deployment", "inferencecache-gateway")
    server = pod_labels("Deployment", "inferencecache-server")
    pol = find(example, "NetworkPolicy", "inferencecache-server")["spec"]
    assert labels_match(pol["podSelector"]["matchLabels"], server)
    by_port = {r["ports"][0]["port"]: r["from"] for r in pol["ingress"]}
    grpc_peers = [p["podSelector"]["matchLabels"] for p in by_port["grpc"]]
    assert any(labels_match(sel, engine) for sel in grpc_peers)
    assert any(labels_match(sel, gateway) for sel in grpc_peers)
    assert not any(labels_match(sel, server) for sel in grpc_peers)
    admin_peers = [p["podSelector"]["matchLabels"] for p in by_port["admin"]]
    assert not any(labels_match(sel, x) for sel in admin_peers for x in (engine, gateway))
    doctor = find(render("doctor"), "Job", "inferencecache-doctor")["spec"]["template"][
        "metadata"]["labels"]
    assert any(labels_match(sel, doctor) for sel in admin_peers)
    assert any(labels_match(p["podSelector"]["matchLabels"], doctor) for p in by_port["grpc"])
    eng = find(example, "NetworkPolicy", "vllm")["spec"]
    assert labels_match(eng["podSelector"]["matchLabels"], engine)
    for rule in eng["ingress"]:  # the KV-event ports: to the doctor only, never to a gateway
        ports = {p["port"] for p in rule["ports"]}
        peers = [p["podSelector"]["matchLabels"] for p in rule["from"] if "podSelector" in p]
        if ports & {5557, 5558}:
            assert all(labels_match(sel, doctor) for sel in peers) and peers
            assert not any(labels_match(sel, gateway) for sel in peers)


def test_server_probes_grpc_health_and_reads_its_token_from_a_secret(example: list[Obj]) -> None:
    dep = find(example, "Deployment", "inferencecache-server")
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": grpc_port}, probe
    token_file = flag(c["args"], "--admin-token-file")
    assert token_file is not None
    mount = next(m for m in c["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "inferencecache-admin-token"
    assert dep["spec"]["replicas"] == 1
    pdb = find(example, "PodDisruptionBudget", "inferencecache-server")["spec"]
    assert labels_match(pdb["selector"]["matchLabels"], spec and dep["spec"]["template"][
        "metadata"]["labels"])


def test_our_containers_run_non_root_read_only_without_capabilities(example: list[Obj]) -> None:
    seen = 0
    everything = example + render("doctor")
    for workload, c in containers(everything):
        if not is_ours(c):
            continue
        seen += 1
        pod = workload["spec"]["template"]["spec"].get("securityContext", {})
        sc = {**pod, **c.get("securityContext", {})}
        assert sc.get("runAsNonRoot") is True and sc.get("runAsUser") == 10001, c["name"]
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        assert sc.get("readOnlyRootFilesystem") is True, c["name"]
        assert sc.get("capabilities") == {"drop": ["ALL"]}, c["name"]
        assert sc.get("seccompProfile") == {"type": "RuntimeDefault"}, c["name"]
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], c["name"]
    assert seen == 4
    images = {c["image"] for _, c in containers(everything) if is_ours(c)}
    assert images == {"registry.example.com/inferencecache:0.1.0"}


def test_monitors_select_the_rendered_services_and_pods(example: list[Obj]) -> None:
    mon = render("observability")
    for name in ("inferencecache-server", "inferencecache-gateway"):
        sm = find(mon, "ServiceMonitor", name)["spec"]
        svc = find(example, "Service", name)
        assert labels_match(sm["selector"]["matchLabels"], svc["metadata"]["labels"]), name
        ports = {p["name"] for p in svc["spec"]["ports"]}
        assert {e["port"] for e in sm["endpoints"]} <= ports, name
    pm = find(mon, "PodMonitor", "inferencecache-subscribers")["spec"]
    sts = find(example, "StatefulSet", "vllm")["spec"]["template"]
    assert labels_match(pm["selector"]["matchLabels"], sts["metadata"]["labels"])
    sidecar = next(c for c in sts["spec"]["containers"] if is_ours(c))
    assert {e["port"] for e in pm["podMetricsEndpoints"]} <= {p["name"] for p in sidecar["ports"]}
    dash = find(mon, "ConfigMap", "inferencecache-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "inferencecache.json" in dash["data"]


def test_the_doctor_job_points_at_every_part_of_the_example_fleet(
    example: list[Obj], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = render("doctor")
    (_, c), = list(containers(job))
    sub, d = container_settings(job, c, monkeypatch)
    assert sub == "doctor"
    s = _settings(example, monkeypatch)
    sts = find(example, "StatefulSet", "vllm")
    pods = [f"vllm-{i}.vllm" for i in range(sts["spec"]["replicas"])]
    sub_port = s["subscribe"].metrics_address.port
    assert d.subscriber_urls == tuple(f"http://{p}:{sub_port}" for p in pods)
    assert str(d.server) == str(s["subscribe"].server)
    assert d.server_http == f"http://inferencecache-server:{s['serve'].http_address.port}"
    assert d.admin_base == f"http://inferencecache-server:{s['serve'].admin_address.port}"
    gw = find(example, "Service", "inferencecache-gateway")["spec"]["ports"][0]["port"]
    assert d.gateway_urls == (f"http://inferencecache-gateway:{gw}",)
    for mine, sidecar in ((d.engine_endpoint, s["subscribe"].engine_endpoint),
                          (d.replay_endpoint, s["subscribe"].replay_endpoint)):
        assert mine == f"tcp://{pods[0]}:" + sidecar.rsplit(":", 1)[1]
    server = find(example, "Deployment", "inferencecache-server")["spec"]["template"]["spec"]
    token_mount = next(m["mountPath"] for m in server["containers"][0]["volumeMounts"])
    assert d.admin_token_file.startswith(token_mount + "/")


def test_event_log_overlay_runs_replicas_on_the_shared_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """deploy/overlays/event-log: N server replicas with --event-log pointing at the overlay's
    Redis Service, snapshots on a mounted path, /readyz as readiness (caught up), and only the
    server pods admitted to Redis."""
    objs = render("overlays/event-log")
    dep = find(objs, "Deployment", "inferencecache-server")
    assert dep["spec"]["replicas"] >= 2
    server = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "server")
    sub, s = container_settings(objs, server, monkeypatch)
    assert sub == "serve"
    host = s.event_log.split("//", 1)[1].split(":", 1)[0]
    redis_svc = find(objs, "Service", host)
    assert redis_svc["spec"]["ports"][0]["port"] == int(s.event_log.rsplit(":", 1)[1].split("/")[0])
    mounts = [m["mountPath"] for m in server["volumeMounts"]]
    assert any(s.snapshot_dir.startswith(m) for m in mounts)
    probe = server["readinessProbe"]
    assert probe["httpGet"]["path"] == "/readyz" and "grpc" not in probe
    sts = find(objs, "StatefulSet", "inferencecache-redis")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert labels_match(redis_svc["spec"]["selector"], pod_labels)
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    policy = find(objs, "NetworkPolicy", "inferencecache-redis")
    peers = [p["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"]
             for p in rule["from"]]
    assert all(labels_match(p, dep["spec"]["template"]["metadata"]["labels"]) for p in peers)
