"""``inferencecache doctor``: check a running deployment, one line per verdict.

Exit codes: 0 when no check failed (SKIPs are fine), 1 when one did, 2 for a bad flag.
"""

from __future__ import annotations

import os

import click

from inferencecache.channels import security_of
from inferencecache.config import CONTEXT, command_options
from inferencecache.doctor.settings import DoctorSettings


@click.command("doctor", context_settings=CONTEXT)
@command_options(DoctorSettings)
def doctor(settings: DoctorSettings) -> int:
    """Check a deployment: server, subscribers, engine, gateways; one line per verdict."""
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    security_of(settings)  # the credential and TLS files, read once: exit 2 when unusable
    from inferencecache.doctor.checks import FAIL, PASS, SKIP, run_checks
    from inferencecache.doctor.gather import gather

    verdicts = run_checks(gather(settings))
    for v in verdicts:
        click.echo(v.line())
    counts = {s: sum(1 for v in verdicts if v.status == s) for s in (PASS, FAIL, SKIP)}
    click.echo(
        f"doctor: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped"
    )
    return 1 if counts[FAIL] else 0
