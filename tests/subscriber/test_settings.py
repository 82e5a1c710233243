"""Flags of ``inferencecache subscribe`` (engine-events-and-subscriber.md §8, §13 items 37, 56-58,
83)."""

from __future__ import annotations

from typing import Any

import click
import pytest

from inferencecache.cli import main
from inferencecache.config import command_options
from inferencecache.subscriber.intake import clamp_backoff
from inferencecache.subscriber.settings import SubscribeSettings

REQUIRED = ["--replica-id", "r0", "--model-id", "m"]


def parse(*args: str, env: dict[str, str] | None = None,
          monkeypatch: pytest.MonkeyPatch | None = None) -> SubscribeSettings:
    got: list[SubscribeSettings] = []

    @click.command()
    @command_options(SubscribeSettings)
    def cmd(settings: SubscribeSettings) -> None:
        got.append(settings)

    cmd.main(list(args), standalone_mode=False)
    return got[0]


def exit_code(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(["subscribe", *args])
    err = capsys.readouterr().err
    return int(e.value.code or 0), err


def test_defaults() -> None:
    s = parse(*REQUIRED)
    assert s.engine_endpoint == "tcp://127.0.0.1:5557"
    assert s.topic == "" and s.tenant_id == "default" and s.hash_scheme == "vllm"
    assert str(s.server) == "127.0.0.1:9090" and str(s.metrics_address) == "127.0.0.1:9091"
    assert s.window == 0.1 and s.stats_interval == 10.0 and s.block_size == 16
    assert s.engine_metrics_url == "http://127.0.0.1:8000/metrics"
    assert s.max_concurrency_ceiling == 256 and s.cache_tier == "auto"
    assert s.ignore_block_removed is False and s.trust_lora_name is True
    assert s.replay_endpoint == "" and s.adapter_names == {}
    assert s.batch_evictions is True
    assert s.refresh_interval == 600.0  # the server's default TTL (30 min) / 3
    assert s.engine_models_url == "http://127.0.0.1:8000/v1/models"
    assert s.adapter_poll_interval == 10.0
    assert s.liveness_window == 30.0  # three 10 s probe intervals


def test_refresh_and_adapter_flags() -> None:
    s = parse(*REQUIRED, "--refresh-interval", "0", "--engine-models-url", "",
              "--adapter-poll-interval", "0", "--engine-metrics-url", "")
    assert s.refresh_interval == 0 and s.engine_models_url == ""
    assert s.effective_adapter_poll_interval == 10.0  # <= 0 means the default, like stats
    s = parse(*REQUIRED, "--refresh-interval", "2m", "--adapter-poll-interval", "1s",
              "--stats-interval", "500ms")
    assert s.refresh_interval == 120.0
    assert s.liveness_window == 3.0  # the slowest probe (the 1 s poll) x 3
    s = parse(*REQUIRED, "--engine-models-url", "", "--stats-interval", "2s")
    assert s.liveness_window == 6.0


@pytest.mark.parametrize(
    ("args", "value"),
    [([], True), (["--batch-evictions"], True), (["--batch-evictions=false"], False),
     (["-batch-evictions=0"], False)],
)
def test_batch_evictions_flag(args: list[str], value: bool) -> None:
    assert parse(*REQUIRED, *args).batch_evictions is value


@pytest.mark.parametrize(
    ("args", "value"),
    [
        (["--ignore-block-removed"], True),
        (["--ignore-block-removed=true"], True),
        (["--ignore-block-removed=false"], False),
        (["-ignore-block-removed=1"], True),
        (["-ignore-block-removed=t"], True),
        (["--ignore-block-removed=0"], False),
    ],
)
def test_s13_83_boolean_flag_spellings(args: list[str], value: bool) -> None:
    assert parse(*REQUIRED, *args).ignore_block_removed is value


@pytest.mark.parametrize(
    ("text", "seconds"), [("1.5s", 1.5), ("1m30s", 90.0), ("0", 0.0), ("20ms", 0.02)]
)
def test_s13_83_go_durations(text: str, seconds: float) -> None:
    assert parse(*REQUIRED, "--window", text).window == pytest.approx(seconds)


def test_s13_56_window_zero_means_100ms_and_backoff_zero_means_1s() -> None:
    assert parse(*REQUIRED, "--window", "0").effective_window == 0.1
    assert parse(*REQUIRED, "--window=-5s").effective_window == 0.1
    assert parse(*REQUIRED, "--stats-interval", "0").effective_stats_interval == 10.0
    assert clamp_backoff(0) == 1.0 and clamp_backoff(-1) == 1.0 and clamp_backoff(0.5) == 0.5


def test_s13_83_lora_names_value_with_equals() -> None:
    assert parse(*REQUIRED, "--lora-adapter-names", "1=a=b").adapter_names == {1: "a=b"}


def test_env_fallback_and_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERENCECACHE_BLOCK_SIZE", "32")
    monkeypatch.setenv("INFERENCECACHE_REPLICA_ID", "from-env")
    monkeypatch.setenv("INFERENCECACHE_TRUST_LORA_NAME", "false")
    s = parse("--model-id", "m")
    assert s.block_size == 32 and s.replica_id == "from-env" and s.trust_lora_name is False
    assert parse("--model-id", "m", "--block-size", "64").block_size == 64


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--model-id", "m"], "replica-id"),
        (["--replica-id", "r"], "model-id"),
        ([*REQUIRED, "--hash-scheme", ""], "hash-scheme"),
        ([*REQUIRED, "--replica-id", ""], "replica-id"),
    ],
)
def test_s13_57_missing_identity_or_empty_scheme_exits_2(
    capsys: pytest.CaptureFixture[str], args: list[str], flag: str
) -> None:
    code, err = exit_code(capsys, *args)
    assert code == 2 and flag in err and err.count("\n") == 1


def test_s13_58_bad_cache_tier_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = exit_code(capsys, *REQUIRED, "--cache-tier", "foo")
    assert code == 2 and "--cache-tier" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--window", "10"], "--window"),
        (["--block-size", "0"], "--block-size"),
        (["--block-size", "x"], "--block-size"),
        (["--max-concurrency-ceiling", "x"], "--max-concurrency-ceiling"),
        (["--lora-adapter-names", "1_0=a"], "--lora-adapter-names"),
        (["--lora-adapter-names", "sql-lora"], "--lora-adapter-names"),
        (["--lora-adapter-names", "x=sql-lora"], "--lora-adapter-names"),
        (["--lora-adapter-names", "1="], "--lora-adapter-names"),
        (["--lora-adapter-names", "1=a,1=b"], "--lora-adapter-names"),
        (["--ignore-block-removed=maybe"], "--ignore-block-removed"),
        (["--server", "nohost"], "--server"),
        (["--metrics-address", "127.0.0.1:x"], "--metrics-address"),
        (["--engine-endpoint", "localhost:5557"], "--engine-endpoint"),
        (["--replay-endpoint", "tcp://nohostport"], "--replay-endpoint"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--stats-interval", "5"], "--stats-interval"),
        (["--refresh-interval", "-1s"], "--refresh-interval"),
        (["--refresh-interval", "10"], "--refresh-interval"),
        (["--engine-models-url", "localhost:8000/v1/models"], "--engine-models-url"),
        (["--adapter-poll-interval", "x"], "--adapter-poll-interval"),
    ],
)
def test_s13_37_83_bad_values_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], flag: str
) -> None:
    code, err = exit_code(capsys, *REQUIRED, *args)
    assert code == 2
    assert flag in err
    assert err.count("\n") == 1, err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["subscribe", "--help"])
    out: Any = capsys.readouterr().out
    assert (e.value.code or 0) == 0
    for flag in ("--engine-endpoint", "--topic", "--replay-endpoint", "--trust-lora-name",
                 "--metrics-address", "--block-size", "--lora-adapter-names",
                 "--refresh-interval", "--engine-models-url", "--adapter-poll-interval"):
        assert flag in out
