"""Flag parsing shared by every subcommand: one typed settings object per binary.

Every flag is also read from ``INFERENCECACHE_<FLAG>`` (upper case, ``-`` -> ``_``); the
command line wins. Values follow the Go reference's syntax (durations such as ``1m30s``,
booleans ``--flag=true``) so existing deployment manifests keep working.
"""

from inferencecache.config.options import (
    CONTEXT,
    DURATION,
    GO_BOOL,
    GO_INT,
    HOST_PORT,
    LOG_LEVEL,
    LOG_LEVELS,
    ZMQ_ENDPOINT,
    command_options,
    env_name,
    log_level_setting,
    setting,
)
from inferencecache.config.values import (
    HostPort,
    format_duration,
    is_go_int,
    is_loopback_host,
    parse_duration,
    parse_go_bool,
    parse_go_int,
    parse_host_port,
    parse_zmq_endpoint,
)

__all__ = [
    "CONTEXT",
    "DURATION",
    "GO_BOOL",
    "GO_INT",
    "HOST_PORT",
    "LOG_LEVEL",
    "LOG_LEVELS",
    "ZMQ_ENDPOINT",
    "HostPort",
    "command_options",
    "env_name",
    "format_duration",
    "is_go_int",
    "is_loopback_host",
    "log_level_setting",
    "parse_duration",
    "parse_go_bool",
    "parse_go_int",
    "parse_host_port",
    "parse_zmq_endpoint",
    "setting",
]
