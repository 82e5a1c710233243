"""The live page (contract-and-index.md §13.6): its JSON paths over HTTP, and the page itself end
to end in headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by Selenium)
against a real ``inferencecache serve`` fed through real gRPC. The browser test writes a
screenshot; with ``INFERENCECACHE_UPDATE_DOCS=1`` it writes ``docs/img/live-page.png``, the one
docs/server.md shows (so a plain test run leaves the work tree as it was)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferencecache import fingerprint
from inferencecache.procs import Children, free_port
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.tokenize import load_tokenizer_dir
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.server.helpers import CONFIG, chain_entry, tokens, update, wait_for
from tests.tokenize.tinytok import write_model

ROOT = Path(__file__).resolve().parents[2]
DOCS_SCREENSHOT = ROOT / "docs" / "img" / "live-page.png"
TOKEN = "s3cret-live"


def _get(url: str, token: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
            ctype = r.headers.get("Content-Type", "")
            return r.status, json.loads(body) if "json" in ctype else body
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, doc: dict[str, Any], token: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), headers=headers,
                                 method="POST")  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def srv() -> Iterator[RunningServer]:
    with running_server(config=CONFIG, admin_token=TOKEN) as s:
        yield s


def test_c13_6_data_paths_follow_the_admin_rule_and_the_page_is_static(srv: RunningServer) -> None:
    status, body = _get(srv.http_url + "/live")
    assert status == 200 and b"<title>inferencecache" in body
    assert b"replicas" in body and b"r1" not in body  # no data in the page itself
    assert _get(srv.http_url + "/live/state")[0] == 401
    assert _get(srv.http_url + "/live/state", "wrong")[0] == 401
    assert _post(srv.http_url + "/live/lookup", {"tokenIds": [1]})[0] == 401
    assert _post(srv.http_url + "/live/state", {}, TOKEN)[0] == 405
    reg = srv.metrics.registry
    assert reg.get_sample_value("inferencecache_live_auth_total", {"result": "unauth"}) == 3


def test_c13_6_state_shows_replicas_partitions_and_changes(srv: RunningServer) -> None:
    assert _get(srv.http_url + "/live/state", TOKEN)[1]["replicas"] == []  # starts observing
    srv.stub().ReportCacheState(iter([
        update("r1", [chain_entry(tokens(32))], stats=pb.ReplicaStats(hit_rate=0.5, pressure=0.25)),
        update("r2", [chain_entry(tokens(16), adapter="sql")]),
    ]), timeout=10)  # fmt: skip
    _, doc = _get(srv.http_url + "/live/state", TOKEN)
    assert [(r["replica"], r["holds"], r["hitRate"], r["pressure"]) for r in doc["replicas"]] == [
        ("r1", 2, 0.5, 0.25),
        ("r2", 1, None, None),
    ]
    assert [(p["adapter"], p["keys"], p["holds"]) for p in doc["partitions"]] == [
        ("", 2, 2),
        ("sql", 1, 1),
    ]
    assert doc["events"]["totals"] == {"PREFIX_ADDED": 3, "REPLICA_UPDATED": 1}
    assert doc["events"]["recent"][0]["replica"] == "r2"  # newest first
    assert doc["events"]["perSecond"] > 0


def test_c13_6_lookup_box_ranks_replicas_and_marks_matched_blocks(srv: RunningServer) -> None:
    srv.stub().ReportCacheState(iter([update("r1", [chain_entry(tokens(32))])]), timeout=10)
    status, doc = _post(srv.http_url + "/live/lookup",
                        {"tenant": "t", "model": "m", "tokenIds": tokens(48)}, TOKEN)  # fmt: skip
    assert status == 200
    assert doc["reason_code"] == "PREFIX_MATCH"
    assert [(s["replica_id"], s["matched_tokens"]) for s in doc["replica_scores"]] == [("r1", 32)]
    hashes, _ = fingerprint.chain(tokens(48), 16)
    assert [(b["hash"], b["matchedBy"]) for b in doc["blocks"]] == [
        (hashes[0].hex(), ["r1"]), (hashes[1].hex(), ["r1"]), (hashes[2].hex(), []),
    ]  # fmt: skip
    bad = _post(srv.http_url + "/live/lookup", {"tokenIds": [1], "text": "x"}, TOKEN)
    assert bad[0] == 400 and b"exactly one" in bad[1]
    assert _post(srv.http_url + "/live/lookup", {"nope": 1}, TOKEN)[0] == 400


# -- the browser ---------------------------------------------------------------------------------


def _chrome(tmp: Path) -> Any:
    """Headless Debian Chromium through its own chromedriver (never a downloaded browser)."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "scripts/check installs chromium and chromium-driver"
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                "--window-size=1280,900", f"--user-data-dir={tmp}"):  # fmt: skip
        opts.add_argument(arg)
    service = Service(executable_path=driver, port=free_port())
    return webdriver.Chrome(options=opts, service=service)


def test_c13_6_live_page_in_headless_chromium(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with Children() as procs:
        serve = procs.start("serve", "--grpc-address", "127.0.0.1:0", "--http-address",
                            "127.0.0.1:0", "--admin-token-file", str(token_file),
                            inherit=False)  # fmt: skip
        rec = serve.wait_log("serving")
        http = "http://" + rec["http_address"]
        channel = grpc.insecure_channel(rec["grpc_address"])
        stub = pb_grpc.InferenceCacheStub(channel)  # type: ignore[no-untyped-call]
        browser = _chrome(Path(tempfile.mkdtemp(dir=tmp_path)))
        try:
            browser.get(http + "/live")
            # the admin token is asked for, then used for every data request
            wait_for(lambda: browser.find_element(By.ID, "auth").is_displayed(), timeout=20)
            browser.find_element(By.ID, "token").send_keys(TOKEN)
            browser.find_element(By.ID, "token-go").click()
            wait_for(lambda: "live" in browser.find_element(By.ID, "status").text, timeout=20)

            def texts(selector: str) -> list[str]:
                # one script call: the page re-renders its tables every second
                got: list[str] = browser.execute_script(
                    "return [...document.querySelectorAll(arguments[0])]"
                    ".map(e => e.innerText.replace(/\\s+/g, ' ').trim())", selector)
                return got

            def rows(table: str) -> list[str]:
                return texts(f"#{table} tbody tr")

            assert rows("replicas") == []
            # replicas appear live as real gRPC ingest arrives
            for i, (rep, hit, pressure) in enumerate([("vllm-0", 0.62, 0.35),
                                                      ("vllm-1", 0.41, 0.7)]):  # fmt: skip
                stub.ReportCacheState(iter([
                    update(rep, [chain_entry(tokens(64 - 32 * i))], tenant="default",
                           model="llama-3-8b", stats=pb.ReplicaStats(hit_rate=hit,
                                                                     pressure=pressure)),
                    update(rep, [chain_entry(tokens(32, 1000), adapter="sql-lora")],
                           tenant="default", model="llama-3-8b"),
                ]), timeout=10)  # fmt: skip
                want = i + 1
                wait_for(lambda: len(rows("replicas")) == want, timeout=20)  # noqa: B023
            assert "vllm-0" in rows("replicas")[0] and "62%" in rows("replicas")[0]
            assert any("sql-lora" in r for r in rows("partitions"))
            wait_for(lambda: any("PREFIX_ADDED" in r for r in rows("events")), timeout=20)
            # the lookup box: token ids in, ranked replicas and matched blocks out
            box = browser.find_element(By.ID, "lk-input")
            box.send_keys(",".join(map(str, tokens(80))))
            browser.find_element(By.ID, "lk-go").click()
            wait_for(lambda: browser.find_elements(By.ID, "lk-reason"), timeout=20)
            assert browser.find_element(By.ID, "lk-reason").text == "PREFIX_MATCH"
            ranked = rows("lk-ranked")
            # default policy: vllm-1's 32-token match is below the 64-token floor
            # (contract-and-index.md §5.8 G1)
            assert [r.split()[1:4:2] for r in ranked] == [["vllm-0", "64"]]
            assert texts("#lk-blocks .blk.hit") == ["0", "1", "2", "3"]  # vllm-0's 4 blocks
            assert len(texts("#lk-blocks .blk")) == 5
            shot = (DOCS_SCREENSHOT if os.environ.get("INFERENCECACHE_UPDATE_DOCS") == "1"
                    else tmp_path / "live-page.png")
            shot.parent.mkdir(parents=True, exist_ok=True)
            assert browser.save_screenshot(str(shot))
            assert shot.stat().st_size > 10_000
        finally:
            browser.quit()
            channel.close()


def test_c13_6_lookup_box_text_goes_through_the_server_tokenizer(tmp_path: Path) -> None:
    write_model(tmp_path, "org/tiny")
    tokenizers = load_tokenizer_dir(tmp_path)
    text = "the quick brown fox jumps over the lazy dog " * 6
    toks = tokenizers.encode_chat("org/tiny", text)
    with running_server(config=CONFIG, tokenizer=tokenizers) as s:
        s.stub().ReportCacheState(iter([update("r1", [chain_entry(toks)], model="org/tiny")]),
                                  timeout=10)  # fmt: skip
        status, doc = _post(s.http_url + "/live/lookup",
                            {"tenant": "t", "model": "org/tiny", "text": text})  # fmt: skip
    assert status == 200 and doc["reason_code"] == "PREFIX_MATCH"
    assert doc["tokenCount"] == len(toks)
    assert len(doc["blocks"]) == len(toks) // 16
    assert all(b["matchedBy"] == ["r1"] for b in doc["blocks"])
