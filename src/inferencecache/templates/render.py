"""Sandboxed rendering of one prompt template (contract-and-index.md §5.15).

Templates are Jinja2 source rendered by ``ImmutableSandboxedEnvironment`` with no loader (so
``include``/``extends``/``import`` cannot read files), no attribute access except on Jinja's
own loop objects, strict undefined variables, a bound on ``*``/``**`` results and on the output
size. Every failure is a ``RenderError``; the caller answers ``RENDER_ERROR``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox

MAX_OUTPUT_BYTES = 1_048_576
"""The largest rendered prompt (the same bound as LookupRoute's prompt_text)."""

_MODEL_LINE = re.compile(r"\A\{#-?\s*model:\s*(\S+?)\s*-?#\}")


class RenderError(Exception):
    """The template failed to compile or render; the message says why (one line)."""


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, tightened: attribute access only on Jinja's loop objects, and ``*``/``**``
    that would build something larger than the output bound refused before it is built."""

    intercepted_binops = frozenset({"*", "**"})

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if isinstance(obj, jinja2.runtime.LoopContext) and not attr.startswith("_"):
            return super().is_safe_attribute(obj, attr, value)
        return False

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        if operator == "**":
            if isinstance(right, int | float) and abs(right) > 64:
                raise jinja2.exceptions.SecurityError("exponent too large")
            return left**right
        for seq, n in ((left, right), (right, left)):
            if (
                isinstance(seq, str | list | tuple)
                and isinstance(n, int)
                and len(seq) * n > MAX_OUTPUT_BYTES
            ):
                raise jinja2.exceptions.SecurityError("repetition too large")
        return left * right


_ENV = _Sandbox(undefined=jinja2.StrictUndefined, autoescape=False, loader=None)


@dataclass(frozen=True, slots=True)
class Template:
    """One compiled template file: ``revision`` names its content (the first 16 hex digits of
    its SHA-256), ``stable`` is the literal text every render starts with, ``model_id`` comes
    from an optional first-line ``{# model: <id> #}`` comment."""

    revision: str
    stable: str
    model_id: str
    compiled: jinja2.Template | None
    error: str = ""

    def render(self, variables: Mapping[str, str]) -> str:
        """The rendered prompt; raises ``RenderError``."""
        if self.compiled is None:
            raise RenderError(self.error)
        parts: list[str] = []
        size = 0
        try:
            for chunk in self.compiled.generate(dict(variables)):
                size += len(chunk)
                if size > MAX_OUTPUT_BYTES:
                    raise RenderError(f"output larger than {MAX_OUTPUT_BYTES} bytes")
                parts.append(chunk)
        except RenderError:
            raise
        except RecursionError:
            raise RenderError("recursion too deep") from None
        except Exception as e:  # undefined variable, sandbox refusal, a template's own error
            raise RenderError(f"{type(e).__name__}: {' '.join(str(e).split())}") from None
        out = "".join(parts)
        if len(out.encode("utf-8", "surrogatepass")) > MAX_OUTPUT_BYTES:
            raise RenderError(f"output larger than {MAX_OUTPUT_BYTES} bytes")
        return out


def compile_template(source: bytes) -> Template:
    """Compile a template file's bytes; a file that is not UTF-8 or not valid Jinja yields a
    ``Template`` whose every render fails (its revision still names the bad content)."""
    revision = hashlib.sha256(source).hexdigest()[:16]
    try:
        text = source.decode("utf-8")
    except UnicodeDecodeError as e:
        return Template(revision, "", "", None, f"template is not UTF-8: {e}")
    m = _MODEL_LINE.match(text)
    model = m.group(1) if m else ""
    try:
        tree = _ENV.parse(text)
        compiled = _ENV.from_string(tree)
    except Exception as e:  # TemplateSyntaxError and anything else the compiler raises
        return Template(revision, "", model, None, f"{type(e).__name__}: {e}")
    return Template(revision, stable_text(tree), model, compiled)


def stable_text(tree: jinja2.nodes.Template) -> str:
    """The literal text at the start of the template, up to its first non-literal node
    (variable, expression, tag): every render begins with exactly this text."""
    out: list[str] = []
    for node in tree.body:
        if not isinstance(node, jinja2.nodes.Output):
            break
        for child in node.nodes:
            if not isinstance(child, jinja2.nodes.TemplateData):
                return "".join(out)
            out.append(child.data)
    return "".join(out)
