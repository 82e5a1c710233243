"""``inferencecache simulate`` and ``inferencecache demo`` (docs/demo.md); their flags are in
``settings.py``."""

from __future__ import annotations

import os
from pathlib import Path

import click

from inferencecache.config import CONTEXT, command_options
from inferencecache.engines.simulated import EngineParams
from inferencecache.sim import cluster
from inferencecache.sim.settings import DemoSettings, SimulateSettings
from inferencecache.sim.workloads import WorkloadSpec


def out_dir_problem(path: str) -> str | None:
    """Why results could not be written into directory ``path`` (created if missing), or None.

    Checked before a run starts, without creating anything: ``path`` is a writable directory, or
    its nearest existing ancestor is one (so the missing directories can be created).
    """
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            return "not a directory"
        if not os.access(p, os.W_OK | os.X_OK):
            return "directory not writable"
        return None
    ancestor = p.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{str(ancestor)!r} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot create it: {str(ancestor)!r} is not writable"
    return None


def check_out_dir(path: str) -> None:
    """``click.UsageError`` (exit 2, one line) when ``--out`` cannot be written."""
    problem = out_dir_problem(path)
    if problem is not None:
        raise click.UsageError(f"--out {path!r}: {problem}")


@click.command("simulate", context_settings=CONTEXT)
@command_options(SimulateSettings)
def simulate(settings: SimulateSettings) -> int:
    """Compare routing policies on simulated engines in simulated time (no sockets)."""
    if settings.out:
        check_out_dir(settings.out)
    from inferencecache.sim.run import run_simulate

    return run_simulate(settings)


@click.command("demo", context_settings=CONTEXT)
@command_options(DemoSettings)
def demo(settings: DemoSettings) -> int:
    """Start server, engines, subscribers and gateway; compare every routing policy."""
    check_out_dir(settings.out)
    from inferencecache.sim.demo import DemoPlan, run

    engine = EngineParams.from_flags(settings)
    overrides = cluster.parse_policy_params(settings.policy_params)
    plan = DemoPlan(
        workload=WorkloadSpec(
            settings.workload,
            settings.requests,
            settings.request_rate,
            settings.seed,
            cluster.MODEL,
        ),
        policies=tuple(cluster.parse_policies(settings.policies)),
        replicas=settings.replicas,
        gateways=settings.gateways,
        engine=engine,
        policy_params=cluster.merged_params(engine, overrides),
        duration=settings.duration,
        out=Path(settings.out),
        event_log=settings.event_log,
    )
    return run(plan)
