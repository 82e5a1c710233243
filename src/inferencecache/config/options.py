"""Click glue: turn a settings dataclass into options with env-var fallbacks.

A binary declares ``@dataclass(frozen=True) class XSettings`` whose fields use ``setting(...)``;
``@command_options(XSettings)`` adds one option per field (``--field-name`` and the Go-style
``-field-name``), reads ``INFERENCECACHE_FIELD_NAME`` when the flag is absent, and hands the
command a validated ``XSettings`` as its ``settings`` argument. Every subcommand is declared
``@click.command(name, context_settings=CONTEXT)`` so ``-h``/``--help`` and the help width are the
same everywhere, and a binary that logs declares ``log_level: str = log_level_setting()``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Final, TypeVar

import click

from inferencecache.config.values import (
    HostPort,
    format_duration,
    parse_duration,
    parse_go_bool,
    parse_go_int,
    parse_host_port,
    parse_zmq_endpoint,
)

ENV_PREFIX = "INFERENCECACHE_"
F = TypeVar("F", bound=Callable[..., Any])

CONTEXT: Final[dict[str, Any]] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
"""``context_settings`` of the ``inferencecache`` group and of every subcommand."""

LOG_LEVELS: Final = ("debug", "info", "warn", "warning", "error")
"""Values of ``--log-level`` (any case; ``warn`` = ``warning``)."""


def env_name(flag: str) -> str:
    """``grpc-address`` -> ``INFERENCECACHE_GRPC_ADDRESS``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


class _Duration(click.ParamType[Any, float]):
    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


class _GoBool(click.ParamType[Any, bool]):
    name = "bool"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, bool):
            return value
        try:
            return parse_go_bool(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


class _GoInt(click.ParamType[Any, int]):
    """Go's ``strconv.Atoi`` for flag values: sign and ASCII digits, int64 range."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return parse_go_int(str(value).strip())
        except ValueError:
            self.fail(f"invalid integer {value!r}", param, ctx)


class _HostPort(click.ParamType[Any, HostPort]):
    name = "host:port"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, HostPort):
            return value
        try:
            return parse_host_port(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


class _ZmqEndpoint(click.ParamType[Any, str]):
    name = "endpoint"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == "":
            return ""
        try:
            return parse_zmq_endpoint(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


DURATION = _Duration()
GO_BOOL = _GoBool()
GO_INT = _GoInt()
HOST_PORT = _HostPort()
ZMQ_ENDPOINT = _ZmqEndpoint()
LOG_LEVEL = click.Choice(LOG_LEVELS, case_sensitive=False)


class _Option(click.Option):
    """An option whose error messages name only its canonical ``--flag`` spelling."""

    def get_error_hint(self, ctx: click.Context | None) -> str:
        return f"'{self.opts[0]}'"


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    param: click.ParamType[Any, Any] | type | None = None,
    required: bool = False,
    metavar: str | None = None,
) -> Any:
    """Declare one flag of a settings dataclass (default, help text, click parameter type)."""
    meta = {"help": help, "param": param, "required": required, "metavar": metavar}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    if isinstance(default, list | dict | set):
        raise TypeError("mutable defaults are not allowed in settings")
    return dataclasses.field(default=default, metadata=meta)


def log_level_setting() -> Any:
    """The ``--log-level`` field every long-running subcommand declares (one definition, so the
    flag means the same everywhere); pass its value to ``inferencecache.logs.setup``."""
    return setting(
        "info",
        param=LOG_LEVEL,
        help="Log level: debug, info, warn or error (JSON lines on stderr).",
    )


def _option_for(f: dataclasses.Field[Any]) -> Callable[[F], F]:
    flag = f.name.replace("_", "-")
    meta = f.metadata
    param = meta.get("param")
    kwargs: dict[str, Any] = {
        "envvar": env_name(flag),
        "show_envvar": True,
        "help": meta.get("help", ""),
        "cls": _Option,
    }
    if meta.get("metavar"):
        kwargs["metavar"] = meta["metavar"]
    has_default = f.default is not dataclasses.MISSING
    if param is GO_BOOL or (param is None and isinstance(f.default, bool)):
        # Go flag semantics: bare --flag means true, --flag=false turns it off.
        kwargs.update(type=GO_BOOL, is_flag=False, flag_value="true")
    elif param is not None:
        kwargs["type"] = param
    if meta.get("required"):
        kwargs["required"] = True
    elif has_default:
        kwargs["default"] = f.default
        kwargs["show_default"] = True
        if param is DURATION and isinstance(f.default, int | float):
            # Given (and so shown by --help) in the syntax the option accepts: 30m, not 1800.0.
            kwargs["default"] = format_duration(f.default)
    return click.option(f"--{flag}", f"-{flag}", f.name, **kwargs)


def command_options(settings_cls: type[Any]) -> Callable[[F], F]:
    """Add one option per settings field; the command receives ``settings=<settings_cls>``."""
    fields = dataclasses.fields(settings_cls)

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            values = {f.name: kwargs.pop(f.name) for f in fields if f.name in kwargs}
            try:
                settings = settings_cls(**values)
            except ValueError as e:  # cross-field validation in __post_init__
                raise click.UsageError(str(e)) from e
            return func(settings=settings, **kwargs)

        out: Callable[..., Any] = wrapper
        for f in reversed(fields):
            out = _option_for(f)(out)
        return out  # type: ignore[return-value]

    return decorate
