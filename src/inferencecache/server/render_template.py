"""The RenderTemplate method body (contract-and-index.md §5.15): find the tenant's template,
render it, fingerprint its stable part. Never raises: a missing template is
``TEMPLATE_NOT_FOUND``, anything that goes wrong rendering is ``RENDER_ERROR``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from inferencecache import fingerprint
from inferencecache.metrics import LazyChildren
from inferencecache.server.metrics import ServerMetrics
from inferencecache.templates import RenderError, Template, TemplateRegistry
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

OK = "OK"
TEMPLATE_NOT_FOUND = "TEMPLATE_NOT_FOUND"
RENDER_ERROR = "RENDER_ERROR"


class TextEncoder(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...


class TextTokenizers(Protocol):
    """The server's tokenizers by model id (``tokenize.TokenizerSet``)."""

    def get(self, model_id: str) -> TextEncoder | None: ...


class Templates:
    """Answers RenderTemplate from a ``TemplateRegistry`` (None: no ``--template-dir``, every
    ref is ``TEMPLATE_NOT_FOUND``)."""

    def __init__(
        self,
        registry: TemplateRegistry | None,
        metrics: ServerMetrics,
        *,
        block_size: int,
        tokenizers: TextTokenizers | None = None,
    ) -> None:
        self._registry = registry
        self._block = block_size
        self._tokenizers = tokenizers
        self._calls = LazyChildren(metrics.render_template_calls)

    def answer(self, request: Any) -> Any:
        """The response to one decoded ``RenderTemplateRequest``."""
        tenant = request.tenant_id
        resp = pb.RenderTemplateResponse(tenant_namespace=tenant.encode("utf-8"))
        template = (
            self._registry.get(tenant, request.template_ref) if self._registry is not None else None
        )
        if template is None:
            resp.reason_code = TEMPLATE_NOT_FOUND
        else:
            resp.template_revision = template.revision
            try:
                text = template.render(request.variables)
                rendered = text.encode("utf-8")
                stable_hash = self.stable_hash(template)
            except (RenderError, UnicodeEncodeError):
                resp.reason_code = RENDER_ERROR
            else:
                resp.rendered_prompt = rendered
                resp.stable_prefix_hash = stable_hash
                resp.reason_code = OK
        self._calls(resp.reason_code).inc()
        return resp

    def fail(self, tenant: str = "") -> Any:
        """The answer to a request whose handling raised (a bug): ``RENDER_ERROR``."""
        self._calls(RENDER_ERROR).inc()
        return pb.RenderTemplateResponse(reason_code=RENDER_ERROR)

    def stable_hash(self, template: Template) -> bytes:
        """contract-and-index.md §5.15: the last chained block hash (8 bytes, big-endian) of
        the stable part's tokens; empty when it is shorter than one block."""
        tokens = self.stable_tokens(template)
        hashes, _counts = fingerprint.chain(tokens, self._block)
        return hashes[-1] if hashes else b""

    def stable_tokens(self, template: Template) -> Sequence[int]:
        """The model's tokens of the stable part without its last token (which may merge with
        the variable text after it), or its UTF-8 bytes when no tokenizer for the template's
        model is loaded."""
        stable = template.stable
        if not stable:
            return ()
        tok = (
            self._tokenizers.get(template.model_id)
            if self._tokenizers is not None and template.model_id
            else None
        )
        if tok is None:
            return list(stable.encode("utf-8"))
        try:
            ids = tok.encode(stable, add_special_tokens=True)
        except Exception as e:
            raise RenderError(f"tokenizer failed: {e}") from None
        return ids[:-1]
