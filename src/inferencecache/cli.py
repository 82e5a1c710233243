"""The one console script, ``inferencecache``, with one subcommand per binary.

Subcommands are imported lazily so that ``inferencecache lookup`` does not pay for importing
the server, and each part of the package owns its own command module.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from inferencecache.config import CONTEXT

# name -> "module:attribute" of a click.Command. Each part registers its binary here.
COMMANDS: dict[str, str] = {
    "subscribe": "inferencecache.subscriber.command:subscribe",
    "fake-engine": "inferencecache.engines.command:fake_engine",
    "serve": "inferencecache.server.command:serve",
    "lookup": "inferencecache.client.command:lookup",
    "gateway": "inferencecache.gateway.command:gateway",
    "simulate": "inferencecache.sim.command:simulate",
    "demo": "inferencecache.sim.command:demo",
    "doctor": "inferencecache.doctor.command:doctor",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*COMMANDS, *super().list_commands(ctx)])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module, _, attr = target.partition(":")
        cmd = getattr(importlib.import_module(module), attr)
        assert isinstance(cmd, click.Command)
        return cmd


@click.group(cls=_LazyGroup, context_settings=CONTEXT)
def group() -> None:
    """KV-cache-aware routing hints for LLM inference fleets."""


@group.command(context_settings=CONTEXT)
def version() -> None:
    """Print the package version."""
    from inferencecache import __version__

    click.echo(__version__)


def main(argv: list[str] | None = None) -> Any:
    """Run the CLI; usage errors print one line naming the problem and exit 2."""
    args = sys.argv[1:] if argv is None else argv
    try:
        rv = group.main(args, prog_name="inferencecache", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help())
        sys.exit(2)
    except click.UsageError as e:
        cmd = e.ctx.command_path if e.ctx is not None else "inferencecache"
        click.echo(f"{cmd}: error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        click.echo(f"inferencecache: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    if isinstance(rv, int):
        sys.exit(rv)
    return rv


if __name__ == "__main__":
    main()
