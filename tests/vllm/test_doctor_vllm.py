"""``inferencecache doctor`` next to real vLLM engines (the session cluster of this folder).

What only a real engine can show: vLLM's own ``vllm:cache_config_info{block_size}``, its
``/v1/models`` LoRA entries, and its KV-event PUB and replay ROUTER over ``ipc://``. Doctor must
read all of them and find the cluster healthy; a subscriber with a wrong block size next to the
engine must fail the block-size line.
"""

from __future__ import annotations

import re

import pytest

from inferencecache.procs import run_cli
from tests.vllm.cluster import Cluster
from tests.vllm.engine import BLOCK

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(300, func_only=True)]


def doctor_args(cluster: Cluster) -> list[str]:
    a = cluster.engines["A"]
    assert a.replay_endpoint is not None
    cluster.serve("A", cluster.prompt("doctor A", blocks=3))  # fresh events in the buffer
    return ["--server", cluster.grpc_address, "--server-http", f"http://{cluster.http_address}",
            "--subscribers", f"http://{cluster.sub_metrics['A']}",
            "--gateways", f"http://{cluster.start_gateway()}",
            "--engine-url", a.url, "--engine-endpoint", a.events_endpoint,
            "--replay-endpoint", a.replay_endpoint, "--events-wait", "2s"]  # fmt: skip


def test_doctor_passes_next_to_real_vllm(cluster: Cluster) -> None:
    res = run_cli(["doctor", *doctor_args(cluster)], timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "FAIL" not in out and "SKIP" not in out, out
    assert re.search(rf"PASS  engine http://\S+: vllm, block size {BLOCK},", out), out
    assert "LoRA adapters sql-lora" in out, out
    assert re.search(rf"PASS  engine events ipc://\S+: \d+ batches .* block size {BLOCK}", out)
    assert "PASS  events flowing A:" in out and "PASS  events flowing B:" in out, out


def test_doctor_flags_a_subscriber_with_another_block_size_than_vllm(cluster: Cluster) -> None:
    a = cluster.engines["A"]
    # No stats (--engine-metrics-url ""), and every event is ignored: nothing of it reaches
    # the server, so the other tests' view of the index is unchanged.
    sub = cluster.start_subscriber("A-wrong-block", a, "--block-size", str(BLOCK * 2),
                                   "--engine-metrics-url", "")  # fmt: skip
    try:
        wrong = f"http://{cluster.sub_metrics['A-wrong-block']}"
        res = run_cli(["doctor", *doctor_args(cluster), "--subscribers", wrong], timeout=60)
    finally:
        cluster.children.stop(sub)
        del cluster.subscribers["A-wrong-block"], cluster.sub_metrics["A-wrong-block"]
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert re.search(rf"FAIL  block size: .*subscriber A-wrong-block \(\S+\) {BLOCK * 2}", out)
