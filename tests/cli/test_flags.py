"""Flags that several subcommands share mean, default and print the same in every one of them.

In process, over the click commands the console script registers (``inferencecache.cli``), plus
``--help`` and ``-h`` of each subcommand as real processes.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any

import click
import pytest

import inferencecache
from inferencecache.cli import COMMANDS, group
from inferencecache.client.command import LookupSettings
from inferencecache.config import CONTEXT, DURATION, parse_duration
from inferencecache.doctor.settings import DoctorSettings
from inferencecache.engines.settings import FakeEngineSettings
from inferencecache.engines.simulated import (
    DEFAULT_DECODE_MS_PER_TOKEN,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFILL_BASE_MS,
    DEFAULT_PREFILL_MS_PER_TOKEN,
)
from inferencecache.gateway.settings import GatewaySettings
from inferencecache.logs import python_level
from inferencecache.procs import run_cli
from inferencecache.server.settings import ServeSettings
from inferencecache.sim import cluster
from inferencecache.sim.settings import DEMO_WORKLOADS, DemoSettings, SimulateSettings
from inferencecache.sim.workloads import WORKLOADS
from inferencecache.subscriber.settings import SubscribeSettings

SETTINGS: dict[str, type[Any]] = {
    "serve": ServeSettings,
    "gateway": GatewaySettings,
    "subscribe": SubscribeSettings,
    "fake-engine": FakeEngineSettings,
    "lookup": LookupSettings,
    "simulate": SimulateSettings,
    "demo": DemoSettings,
    "doctor": DoctorSettings,
}


def commands() -> dict[str, click.Command]:
    ctx = click.Context(group)
    out = {}
    for name in COMMANDS:
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        out[name] = cmd
    return out


def option(cmd: click.Command, name: str) -> click.Option | None:
    for p in cmd.params:
        if isinstance(p, click.Option) and p.name == name:
            return p
    return None


def test_every_subcommand_has_its_settings_class_here() -> None:
    assert set(SETTINGS) == set(COMMANDS)


# ---- durations in --help ----------------------------------------------------------------------


def duration_options() -> list[tuple[str, click.Option]]:
    out = []
    for name, cmd in commands().items():
        for p in cmd.params:
            if isinstance(p, click.Option) and p.type is DURATION and p.default is not None:
                out.append((name, p))
    return out


def shown_default(cmd_name: str, cmd: click.Command, opt: click.Option) -> str:
    record = opt.get_help_record(click.Context(cmd, info_name=cmd_name))
    assert record is not None
    m = re.search(r"default: ([^;\]]+)\]", record[1])
    assert m is not None, record
    return m.group(1)


def test_duration_options_are_the_settings_duration_fields() -> None:
    """The option list below is complete: every DURATION field of every settings class."""
    from_settings = {
        (name, f.name)
        for name, cls in SETTINGS.items()
        for f in dataclasses.fields(cls)
        if f.metadata.get("param") is DURATION and f.default is not None
    }
    from_commands = {(name, opt.name) for name, opt in duration_options()}
    assert from_commands == from_settings
    assert ("serve", "default_ttl") in from_commands and len(from_commands) > 15


@pytest.mark.parametrize(
    ("cmd_name", "opt_name"), [(n, o.name) for n, o in duration_options()]
)
def test_help_shows_duration_defaults_the_parser_reads_back(cmd_name: str, opt_name: str) -> None:
    cmd = commands()[cmd_name]
    opt = option(cmd, opt_name)
    assert opt is not None
    shown = shown_default(cmd_name, cmd, opt)
    field = {f.name: f for f in dataclasses.fields(SETTINGS[cmd_name])}[opt_name]
    # What --help shows is a Go duration (a bare "1800.0" is rejected by the parser) ...
    assert parse_duration(shown) == field.default, (cmd_name, opt_name, shown)
    # ... and what the command receives when the flag is absent is the settings' default.
    ctx = click.Context(cmd, info_name=cmd_name)
    assert opt.type_cast_value(ctx, opt.get_default(ctx)) == field.default


@pytest.mark.parametrize("cmd_name", sorted(COMMANDS))
def test_help_output_prints_every_duration_default_as_a_duration(cmd_name: str) -> None:
    cmd = commands()[cmd_name]
    r = run_cli([cmd_name, "--help"])
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for name, opt in duration_options():
        if name == cmd_name:
            shown = shown_default(cmd_name, cmd, opt)
            assert f"default: {shown}]" in text, (opt.opts[0], shown)
            assert not re.fullmatch(r"[0-9.]+", shown)


def test_serve_help_shows_the_ttl_as_30m() -> None:
    r = run_cli(["serve", "--help"])
    text = " ".join(r.stdout.split())
    assert "INFERENCECACHE_DEFAULT_TTL; default: 30m]" in text
    assert "1800.0" not in text


# ---- --log-level --------------------------------------------------------------------------------


def test_log_level_is_one_definition_in_every_long_running_command() -> None:
    found = {n: option(c, "log_level") for n, c in commands().items()}
    have = {n: o for n, o in found.items() if o is not None}
    assert {"serve", "gateway", "subscribe", "fake-engine"} <= set(have)
    ref = have["serve"]
    assert isinstance(ref.type, click.Choice)
    for name, opt in have.items():
        assert isinstance(opt.type, click.Choice), name
        assert opt.opts == ref.opts == ["--log-level", "-log-level"], name
        assert list(opt.type.choices) == list(ref.type.choices), name
        assert opt.type.case_sensitive is False, name
        assert (opt.default, opt.help, opt.envvar) == (
            ref.default, ref.help, "INFERENCECACHE_LOG_LEVEL"
        ), name


@pytest.mark.parametrize(
    ("value", "level"),
    [("debug", "DEBUG"), ("INFO", "INFO"), ("warn", "WARNING"), ("Warning", "WARNING"),
     ("error", "ERROR")],
)
def test_log_level_values_map_to_logging_levels(value: str, level: str) -> None:
    assert python_level(value) == level


@pytest.mark.parametrize("cmd_name", ["subscribe", "fake-engine"])
def test_bad_log_level_exits_2_with_one_line(cmd_name: str) -> None:
    args = ["--replica-id", "r", "--model-id", "m"] if cmd_name == "subscribe" else []
    for argv, env in (([*args, "--log-level", "loud"], None),
                      (args, {"INFERENCECACHE_LOG_LEVEL": "loud"})):
        r = run_cli([cmd_name, *argv], env=env)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and "--log-level" in r.stderr, r.stderr


# ---- --workload / --mode ------------------------------------------------------------------------


def test_workload_flag_only_means_the_traffic_scenario() -> None:
    with_workload = {n: option(c, "workload") for n, c in commands().items()}
    users = {n: o for n, o in with_workload.items() if o is not None}
    assert set(users) == {"simulate", "demo"}
    for name, opt in users.items():
        assert isinstance(opt.type, click.Choice), name
        # the demo's engines serve fixed adapters: lora-churn is simulate-only
        want = set(WORKLOADS) if name == "simulate" else set(DEMO_WORKLOADS)
        assert want <= set(opt.type.choices) <= {*want, "all"}, name
    assert set(DEMO_WORKLOADS) == set(WORKLOADS) - {"lora-churn"}


def test_fake_engine_selects_its_behaviour_with_mode() -> None:
    opt = option(commands()["fake-engine"], "mode")
    assert opt is not None
    assert opt.envvar == "INFERENCECACHE_MODE" and opt.default == "fixed"


def test_mode_is_read_from_the_environment() -> None:
    r = run_cli(["fake-engine", "--bind", "tcp://127.0.0.1:0", "--http-address", ""],
                env={"INFERENCECACHE_MODE": "script"})
    assert r.returncode == 2
    assert r.stderr.strip().endswith("--script: required with --mode script"), r.stderr


def test_old_workload_spelling_of_mode_is_gone() -> None:
    r = run_cli(["fake-engine", "--workload", "random"])
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "No such option '--workload'" in r.stderr, r.stderr


# ---- engine model defaults ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("prefill_ms_per_token", DEFAULT_PREFILL_MS_PER_TOKEN),
        ("prefill_base_ms", DEFAULT_PREFILL_BASE_MS),
        ("decode_ms_per_token", DEFAULT_DECODE_MS_PER_TOKEN),
        ("max_num_seqs", DEFAULT_MAX_NUM_SEQS),
    ],
)
def test_engine_model_flags_default_the_same_everywhere(name: str, value: float) -> None:
    users = {n: o for n, c in commands().items() if (o := option(c, name)) is not None}
    assert set(users) == {"fake-engine", "simulate", "demo"}
    for cmd_name, opt in users.items():
        assert opt.default == value, cmd_name
    # the value the demo's published numbers were measured with
    assert getattr(cluster.DEFAULT_ENGINE, name) == value


def test_demo_prefill_default_is_unchanged() -> None:
    assert DEFAULT_PREFILL_MS_PER_TOKEN == 0.1


# ---- the shared context settings ----------------------------------------------------------------


def test_no_subcommand_module_imports_the_top_level_cli() -> None:
    root = Path(inferencecache.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "cli.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n == "inferencecache.cli" for n in names):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []


def test_every_command_uses_the_shared_context_settings() -> None:
    assert group.context_settings is CONTEXT
    for name, cmd in commands().items():
        assert cmd.context_settings is CONTEXT, name


@pytest.mark.parametrize("cmd_name", sorted(COMMANDS))
def test_short_help_option_works_everywhere(cmd_name: str) -> None:
    r = run_cli([cmd_name, "-h"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"Usage: inferencecache {cmd_name} ")
