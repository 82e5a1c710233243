"""Load ``<dir>/<model_id>/tokenizer.json`` + chat template once; encode one user message.

The rendering follows what an OpenAI-compatible engine does for a chat request, so the server's
tokens (and therefore fingerprints) equal the engine's: the model's ``chat_template`` from
``tokenizer_config.json`` (or a sibling ``chat_template.jinja``) is rendered in a sandboxed jinja2
environment with exactly one ``{"role": "user", "content": text}`` message,
``add_generation_prompt=True`` and the config's special tokens (``bos_token``, ``eos_token``, ...);
the rendered string is then encoded *without* adding special tokens again (the template owns
them). A model without any chat template encodes the raw text with the tokenizer's own special
tokens, the way an engine tokenizes a plain completion prompt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"

_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class TokenizerLoadError(Exception):
    """A tokenizer directory or file could not be loaded; the message is one line."""


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Chat templates expect non-ASCII text to pass through unescaped (as the engines render it).
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        autoescape=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def pick_template(raw: Any) -> str | None:
    """``chat_template`` may be a string or a list of ``{"name", "template"}`` (use "default")."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {
            t.get("name"): t.get("template")
            for t in raw
            if isinstance(t, dict) and isinstance(t.get("template"), str)
        }
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


class ChatTokenizer:
    """One model's tokenizer plus its compiled chat template (None: raw-text encoding)."""

    def __init__(
        self,
        model_id: str,
        tokenizer: Tokenizer,
        template: str | None = None,
        special_tokens: Mapping[str, Any] | None = None,
    ) -> None:
        self.model_id = model_id
        self.template_source = template  # the chat template text (None: no template)
        self._tokenizer = tokenizer
        self._context: dict[str, Any] = {}
        for key, value in (special_tokens or {}).items():
            if key == "additional_special_tokens" and isinstance(value, list):
                texts = [_token_text(v) for v in value]
                self._context[key] = [t for t in texts if t is not None]
                continue
            text = _token_text(value)
            if text is not None:
                self._context[key] = text
        self._template = _environment().from_string(template) if template is not None else None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` encoded as a plain string (no template), with or without the
        tokenizer's own special tokens (BOS, ...)."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_template(self, **variables: Any) -> str:
        """The chat template rendered with the model's special tokens (``bos_token``, ...) and
        ``variables`` (which win over them); ValueError for a model without a template. Errors
        the template raises (``raise_exception``, a bad variable) propagate."""
        if self._template is None:
            raise ValueError(f"model {self.model_id!r} has no chat template")
        return self._template.render({**self._context, **variables})

    def render(self, text: str) -> str:
        """The prompt string the engine would see for one user message (generation prompt on)."""
        if self._template is None:
            return text
        return self.render_template(
            messages=[{"role": "user", "content": text}],
            add_generation_prompt=True,
            tools=None,
            documents=None,
        )

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of ``text`` as one chat turn (see the module doc for templateless models)."""
        if self._template is None:
            return self.encode(text, add_special_tokens=True)
        return self.encode(self.render(text), add_special_tokens=False)


class TokenizerSet:
    """The loaded tokenizers by ``model_id``; implements the index's ``PromptTokenizer``.

    ``model_id`` is only ever a dict key here, never a path, so a request cannot make the server
    read a file.
    """

    def __init__(self, models: Mapping[str, ChatTokenizer] | None = None) -> None:
        self._models: dict[str, ChatTokenizer] = dict(models or {})

    def __len__(self) -> int:
        return len(self._models)

    @property
    def model_ids(self) -> list[str]:
        return sorted(self._models)

    def get(self, model_id: str) -> ChatTokenizer | None:
        return self._models.get(model_id)

    def has_model(self, model_id: str) -> bool:
        return model_id in self._models

    def encode_chat(self, model_id: str, text: str) -> list[int]:
        """Tokens of ``text`` as one user turn of ``model_id``; KeyError for an unknown model."""
        return self._models[model_id].encode_chat(text)


def load_model(model_id: str, directory: Path) -> ChatTokenizer:
    """Load one model directory (``tokenizer.json`` required, config and template optional)."""
    tok_path = directory / TOKENIZER_FILE
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # the Rust loader raises a bare Exception on bad JSON
        raise TokenizerLoadError(f"cannot load {tok_path}: {_one_line(e)}") from e
    config: dict[str, Any] = {}
    cfg_path = directory / CONFIG_FILE
    if cfg_path.exists():
        try:
            loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerLoadError(f"cannot read {cfg_path}: {_one_line(e)}") from e
        if not isinstance(loaded, dict):
            raise TokenizerLoadError(f"cannot read {cfg_path}: not a JSON object")
        config = loaded
    template = pick_template(config.get("chat_template"))
    tpl_path = directory / TEMPLATE_FILE
    if template is None and tpl_path.exists():
        try:
            template = tpl_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerLoadError(f"cannot read {tpl_path}: {_one_line(e)}") from e
    special = {k: config[k] for k in (*_SPECIAL_KEYS, "additional_special_tokens") if k in config}
    try:
        return ChatTokenizer(model_id, tokenizer, template, special)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerLoadError(f"bad chat_template for {model_id!r}: {_one_line(e)}") from e


def load_tokenizer_dir(path: str | os.PathLike[str]) -> TokenizerSet:
    """Every ``<path>/<model_id>/tokenizer.json`` (model ids may contain ``/``), loaded now."""
    root = Path(path)
    if not root.is_dir():
        raise TokenizerLoadError(f"tokenizer dir {str(root)!r} is not a readable directory")
    models: dict[str, ChatTokenizer] = {}
    # Links are followed (a model entry is often a link to the engine's model folder); a link
    # back to a folder already on the walked path would loop, so it is not entered.
    chains: dict[str, tuple[str, ...]] = {os.fspath(root): (os.path.realpath(root),)}
    for current, dirs, files in os.walk(root, onerror=_raise_walk_error, followlinks=True):
        chain = chains.pop(current)
        keep = []
        for name in sorted(dirs):
            real = os.path.realpath(os.path.join(current, name))
            if real not in chain:
                chains[os.path.join(current, name)] = (*chain, real)
                keep.append(name)
        dirs[:] = keep
        if TOKENIZER_FILE not in files:
            continue
        rel = Path(current).relative_to(root)
        if rel == Path("."):
            continue  # a tokenizer at the root has no model id
        model_id = rel.as_posix()
        models[model_id] = load_model(model_id, Path(current))
    return TokenizerSet(models)


def _raise_walk_error(err: OSError) -> None:
    raise TokenizerLoadError(f"cannot read {err.filename}: {err.strerror}")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
