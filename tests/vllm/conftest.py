"""Session fixtures of the real-vLLM tests: the setup step and the running cluster.

A failed ``scripts/setup-vllm`` fails every test here (never a skip): the issue asks CI to fail
loudly when the engine cannot be installed, e.g. with PyPI unreachable.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm.cluster import Cluster, make_cluster
from tests.vllm.engine import SetupFailed, VllmAssets, run_setup

TIMINGS: dict[str, float] = {}
NOTES: dict[str, str] = {}


@pytest.fixture(scope="session")
def vllm_assets() -> VllmAssets:
    try:
        assets = run_setup()
    except SetupFailed as e:
        failure = str(e)
    else:
        TIMINGS["scripts/setup-vllm"] = assets.setup_seconds
        return assets
    pytest.fail(failure, pytrace=False)


@pytest.fixture(scope="session")
def cluster(vllm_assets: VllmAssets,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = make_cluster(vllm_assets, tmp_path_factory.mktemp("vllm"))
    try:
        yield c
    finally:
        TIMINGS.update(c.timings)
        NOTES.update(c.notes)
        for name, engine in c.engines.items():
            for i, took in enumerate(engine.starts[1:], 2):
                TIMINGS[f"engine {name} start #{i}"] = took
        c.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS or NOTES:
        terminalreporter.write_sep("-", "vLLM end-to-end timings")
        for what, seconds in TIMINGS.items():
            terminalreporter.write_line(f"{what}: {seconds:.1f}s")
        for what, note in NOTES.items():
            terminalreporter.write_line(f"{what}: {note}")
