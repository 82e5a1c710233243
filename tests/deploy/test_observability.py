"""deploy/observability: the alert rules pass ``promtool test rules``, every metric the rules and
the dashboard name is exported by a running server, subscriber or gateway, and a real Prometheus
on 127.0.0.1 scrapes them and evaluates every rule (docs/deploy.md, "Observability").
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from inferencecache.procs import Child, Children, RedisServer, free_port
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.deploy.manifests import DEPLOY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

OBS = DEPLOY / "observability"
JOBS = {  # the job names the Prometheus Operator gives these targets (see prometheusrule.yaml)
    "server": "inferencecache-server",
    "subscriber": "inferencecache/inferencecache-subscribers",
    "gateway": "inferencecache-gateway",
}
NAME = re.compile(r"\b(inferencecache[_:][a-zA-Z0-9_:]*)")


def rules_spec() -> dict[str, Any]:
    spec = yaml.safe_load((OBS / "prometheusrule.yaml").read_text())["spec"]
    assert isinstance(spec, dict)
    return spec


def write_rules(directory: Path) -> Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_spec(), sort_keys=False))
    return path


def rules() -> list[dict[str, Any]]:
    return [r for g in rules_spec()["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads((OBS / "grafana-dashboard.json").read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append(target["expr"])
    return out


def test_promtool_checks_and_unit_tests_the_rules(tmp_path: Path) -> None:
    write_rules(tmp_path)
    shutil.copy(OBS / "tests" / "rules-test.yaml", tmp_path / "rules-test.yaml")
    check = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yaml")],
                           capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    res = subprocess.run(["promtool", "test", "rules", "rules-test.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr
    # Every alert has a unit test that expects it to fire.
    tested = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts:\n\s+- exp_labels",
                            (OBS / "tests" / "rules-test.yaml").read_text()))  # fmt: skip
    assert tested == {r["alert"] for r in rules() if "alert" in r}


@dataclass
class Stack:
    children: Children = field(default_factory=Children)
    server: Child | None = None
    grpc: str = ""
    urls: dict[str, str] = field(default_factory=dict)  # part -> host:port of its /metrics
    redis: RedisServer | None = None
    tmp: tempfile.TemporaryDirectory[str] | None = None

    def close(self) -> None:
        try:
            self.children.stop_all()
        finally:
            if self.redis is not None:
                self.redis.stop()
            if self.tmp is not None:
                self.tmp.cleanup()


def start_stack() -> Stack:
    """Server (on the shared event log, so its metrics are exported too), subscriber, gateway."""
    s = Stack()
    try:
        s.tmp = tempfile.TemporaryDirectory(prefix="obs-redis-")
        s.redis = RedisServer(s.tmp.name).start()
        s.server = s.children.start("serve", "--grpc-address", "127.0.0.1:0", "--http-address",
                                    "127.0.0.1:0", "--max-holds", "1000",
                                    "--event-log", s.redis.url)  # fmt: skip
        rec = s.server.wait_log("serving", timeout=30)
        s.grpc, s.urls["server"] = rec["grpc_address"], rec["http_address"]
        engine = s.children.start("fake-engine", "--mode", "script", "--script", "-", "--bind",
                                  "tcp://127.0.0.1:0", "--http-address", "127.0.0.1:0",
                                  stdin=True)  # fmt: skip
        ready = engine.wait_log("fake engine ready", timeout=30)
        sub = s.children.start(
            "subscribe", "--replica-id", "r0", "--model-id", "m", "--engine-endpoint",
            ready["endpoint"], "--server", s.grpc, "--metrics-address", "127.0.0.1:0",
            "--engine-metrics-url", f"http://{ready['http_address']}/metrics",
        )
        s.urls["subscriber"] = sub.wait_log("metrics listening", timeout=30)["address"]
        gw = s.children.start("gateway", "--engines", f"r0=http://{ready['http_address']}",
                              "--server", s.grpc, "--http-address", "127.0.0.1:0")  # fmt: skip
        s.urls["gateway"] = gw.wait_log("serving", timeout=30)["http_address"]
    except BaseException:
        s.close()
        raise
    return s


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack()
    try:
        yield s
    finally:
        s.close()


def exported(url: str) -> set[str]:
    """Every sample name a /metrics page can carry, from its TYPE lines (labelled series appear
    on first use, their families are always declared)."""
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    names: set[str] = set()
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M):
        name, kind = m.groups()
        if kind == "histogram":
            names.update(name + s for s in ("_bucket", "_sum", "_count"))
        elif kind == "summary":
            names.update((name, name + "_sum", name + "_count"))
        else:
            names.add(name)
    return names


def test_every_metric_the_rules_and_dashboard_name_is_exported(stack: Stack) -> None:
    have = set().union(*(exported(url) for url in stack.urls.values()))
    recorded = {r["record"] for r in rules() if "record" in r}
    used: dict[str, str] = {}
    for where, exprs in (("rules", [r["expr"] for r in rules()]), ("dashboard", dashboard_exprs())):
        for expr in exprs:
            for name in NAME.findall(expr):
                used.setdefault(name, where)
    assert len(used) > 30
    missing = {n: w for n, w in used.items() if n not in have and n not in recorded}
    assert not missing, f"named but not exported: {missing}"
    # The dashboard reads the three components and the info series doctor compares.
    dash_names = {n for e in dashboard_exprs() for n in NAME.findall(e)}
    for part in ("inferencecache_server_info", "inferencecache_subscriber_info",
                 "inferencecache_gateway_info", "inferencecache_index_holds"):
        assert part in dash_names


def test_dashboard_is_well_formed() -> None:
    dash = json.loads((OBS / "grafana-dashboard.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert dash["templating"]["list"][0]["name"] == "datasource"
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]


# ---- a real Prometheus ------------------------------------------------------------------------


def api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        doc = json.loads(r.read())
    assert doc["status"] == "success", doc
    return doc["data"]


def wait_for(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, ValueError, KeyError, AssertionError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"{what} not reached in {timeout:.0f}s; last: {last!r}")


def test_real_prometheus_scrapes_the_processes_and_evaluates_every_rule(tmp_path: Path) -> None:
    s = start_stack()
    try:
        rules_file = write_rules(tmp_path)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules_file)],
            "scrape_configs": [
                {"job_name": JOBS[part], "static_configs": [{"targets": [url]}]}
                for part, url in s.urls.items()
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        prom = s.children.popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

        def targets_up() -> bool:
            assert prom.poll() is None, "prometheus exited"
            active = api(port, "targets")["activeTargets"]
            return len(active) == 3 and all(t["health"] == "up" for t in active)

        wait_for("all three targets up", targets_up)
        channel = grpc.insecure_channel(s.grpc)
        stub = pb_grpc.InferenceCacheStub(channel)  # type: ignore[no-untyped-call]

        def recorded() -> list[Any]:
            for i in range(5):  # lookups keep coming, so the counter grows between scrapes
                stub.LookupRoute(pb.LookupRouteRequest(model_id="m", tenant_id="default",
                                                       hash_scheme="vllm",
                                                       token_ids=list(range(i, i + 64))),
                                 timeout=5)  # fmt: skip
            res = api(port, "query", query="inferencecache:lookup_route_calls:rate5m")["result"]
            return [r for r in res if float(r["value"][1]) > 0]

        try:
            rows = wait_for("the recording rule over real lookups", recorded)
        finally:
            channel.close()
        assert {r["metric"]["reason_code"] for r in rows} == {"NO_HINT"}

        def all_rules_evaluated() -> list[Any]:
            groups = api(port, "rules")["groups"]
            got = [r for g in groups for r in g["rules"]]
            assert len(got) == len(rules())
            bad = [(r["name"], r.get("lastError")) for r in got if r["health"] != "ok"]
            assert not bad, bad
            return got

        evaluated = wait_for("every rule evaluated without error", all_rules_evaluated)
        firing = [r["name"] for r in evaluated if r.get("state") in ("pending", "firing")]
        # A healthy, idle stack: only "the subscriber never heard from its engine" may be
        # pending (this fake engine has published nothing).
        assert set(firing) <= {"InferenceCacheSubscriberNoEngineEvents"}, firing
        for part, job in JOBS.items():
            q = f'{{job="{job}", __name__=~"inferencecache_{part}_info"}}'
            assert api(port, "query", query=q)["result"], part
        holds = api(port, "query", query="inferencecache_index_max_holds")["result"]
        assert [float(r["value"][1]) for r in holds] == [1000.0]

        assert s.server is not None
        s.children.stop(s.server)

        def server_down_pending() -> bool:
            alerts = api(port, "alerts")["alerts"]
            return any(a["labels"]["alertname"] == "InferenceCacheServerDown" for a in alerts)

        wait_for("InferenceCacheServerDown once the server is gone", server_down_pending)
    finally:
        s.close()
