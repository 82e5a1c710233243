"""Where templates live (contract-and-index.md §5.15): ``<template-dir>/<tenant_id>/<ref>.j2``,
``<template-dir>/<ref>.j2`` for the empty tenant.

A tenant sees only its own directory. Names are checked before they touch the file system, so
a ref or tenant can never name a path outside the directory. A file is compiled on first use
and re-read when its (mtime, size, inode) changes, checked at most once a second per file.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import Counter

from inferencecache.config.reloading import RELOAD_CHECK_S, Signature, signature
from inferencecache.templates.render import Template, compile_template

SUFFIX = ".j2"
MAX_TEMPLATE_BYTES = 1_048_576
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


class TemplateDirError(ValueError):
    """``--template-dir`` is not a readable directory."""


class _Entry:
    __slots__ = ("checked", "sig", "template")

    def __init__(self, sig: Signature, template: Template, checked: float) -> None:
        self.sig = sig
        self.template = template
        self.checked = checked


def valid_name(name: str) -> bool:
    """A tenant id or template ref usable as one path component (no separators, no dot
    files, no ``..``)."""
    return _NAME.fullmatch(name) is not None and ".." not in name


class TemplateRegistry:
    """Per-tenant named templates from one directory; thread-safe."""

    def __init__(
        self,
        directory: str | Path,
        *,
        reloads: Counter | None = None,
        every: float = RELOAD_CHECK_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise TemplateDirError(f"{str(self.directory)!r} is not a directory")
        self._reloads = reloads
        self._every = every
        self._mono = monotonic
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], _Entry] = {}

    def path(self, tenant_id: str, ref: str) -> Path | None:
        """The file of ``ref`` for ``tenant_id``, or None when either is not a valid name."""
        if not valid_name(ref) or (tenant_id and not valid_name(tenant_id)):
            return None
        base = self.directory / tenant_id if tenant_id else self.directory
        return base / (ref + SUFFIX)

    def get(self, tenant_id: str, ref: str) -> Template | None:
        """The current template, or None when it does not exist (TEMPLATE_NOT_FOUND)."""
        key = (tenant_id, ref)
        now = self._mono()
        entry = self._entries.get(key)
        if entry is not None and now - entry.checked < self._every:
            return entry.template
        path = self.path(tenant_id, ref)
        if path is None:
            return None
        sig = signature(path)
        with self._lock:
            entry = self._entries.get(key)
            if sig is None:
                self._entries.pop(key, None)
                return None
            if entry is not None and entry.sig == sig:
                entry.checked = now
                return entry.template
            try:
                with open(path, "rb") as f:
                    source = f.read(MAX_TEMPLATE_BYTES + 1)
            except OSError:
                self._entries.pop(key, None)
                return None
            template = compile_template(source)
            if len(source) > MAX_TEMPLATE_BYTES:
                template = Template(template.revision, "", "", None, "template file too large")
            if entry is not None and self._reloads is not None:
                self._reloads.labels("template", "ok" if template.compiled else "error").inc()
            self._entries[key] = _Entry(sig, template, now)
            return template
