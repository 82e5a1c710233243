"""The prompt token ids an OpenAI-compatible engine (vLLM) computes for a request body.

A gateway fingerprints these ids, and the subscriber fingerprints the ids the engine reports in
its KV events; the two chains are only equal when the gateway tokenizes *exactly* like the
engine. The rules here follow vLLM's OpenAI server (checked against vLLM 0.32's request models):

``/v1/completions`` (``completion_prompt_ids``)
    - a string prompt is encoded with the tokenizer's own special tokens (its post-processor,
      e.g. a BOS), unless the body sets vLLM's ``"add_special_tokens": false``;
    - a list of ints is used as is; a batch (list of strings or of int lists) is routed by its
      first prompt (the whole batch goes to one engine);
    - ``truncate_prompt_tokens`` keeps the last (``truncation_side: "right"``: first) k ids.
``/v1/chat/completions`` (``chat_prompt_ids``)
    - the model's chat template is rendered over the full ``messages`` list with
      ``add_generation_prompt`` (default true), ``continue_final_message``, ``tools``,
      ``documents``, ``chat_template_kwargs`` and the special tokens of
      ``tokenizer_config.json``; the text is encoded *without* adding special tokens
      (``"add_special_tokens": true`` in the body adds them, as in vLLM);
    - text content parts are joined with ``"\\n"`` unless the template iterates over a
      message's content parts itself (then the parts are passed through); an assistant tool
      call's JSON ``arguments`` string is parsed into an object, as vLLM does for templates;
    - non-text parts (images, audio, ...) change the ids in ways only the engine knows:
      ``UnsupportedPrompt``.

``PromptError`` means the body is malformed (the gateway answers 400); ``UnsupportedPrompt``
means it is valid but cannot be tokenized here (route without a fingerprint). The model's
tokenizer and template come from ``inferencecache.tokenize.chat``, loaded once at startup.
"""

from __future__ import annotations

import array
import copy
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inferencecache.fingerprint import MAX_U32
from inferencecache.tokenize.chat import ChatTokenizer, load_tokenizer_dir

_SENTINEL = "\x00INFERENCECACHE_CONTINUE\x00"
# A template that loops over a message's content parts ("openai" content format).
_ITERATES_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)"
)


class PromptError(ValueError):
    """The request body is malformed (HTTP 400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedPrompt(Exception):
    """A valid request whose engine token ids cannot be reproduced here (no fingerprint)."""


@dataclass(frozen=True)
class EngineTokenizer:
    """One model's tokenizer and chat template, plus how the template wants message content."""

    chat: ChatTokenizer
    content_parts: bool = False  # the template iterates over content parts ("openai" format)

    @property
    def model_id(self) -> str:
        return self.chat.model_id


def uses_content_parts(template_source: str | None) -> bool:
    """Whether a chat template loops over a message's content parts (vLLM's "openai" format)."""
    return bool(template_source and _ITERATES_CONTENT.search(template_source))


def load_engine_tokenizers(path: str | os.PathLike[str]) -> dict[str, EngineTokenizer]:
    """Every model of a ``--tokenizer-dir`` (``TokenizerLoadError`` as ``load_tokenizer_dir``)."""
    tokenizers = load_tokenizer_dir(path)
    out: dict[str, EngineTokenizer] = {}
    for model_id in tokenizers.model_ids:
        chat = tokenizers.get(model_id)
        assert chat is not None
        parts = uses_content_parts(chat.template_source)
        out[model_id] = EngineTokenizer(chat, parts)
    return out


def _token_list(value: Sequence[Any], param: str) -> list[int]:
    # Fast path (C loops): all plain ints (no bools) and all within uint32.
    if set(map(type, value)) == {int}:
        try:
            array.array("I", value)
            return list(value)
        except OverflowError:
            pass
    out: list[int] = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= MAX_U32:
            raise PromptError(f"{param}[{i}] is not a token id in 0..{MAX_U32}", param)
        out.append(item)
    return out


def _truncate(ids: list[int], body: Mapping[str, Any]) -> list[int]:
    k = body.get("truncate_prompt_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0 or len(ids) <= k:
        return ids
    if body.get("truncation_side") == "right":
        return ids[:k]
    return ids[len(ids) - k :] if k else []


def completion_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The first prompt of a ``/v1/completions`` body: a string or token ids (PromptError)."""
    if "prompt" not in body or body["prompt"] is None:
        raise PromptError("missing required field 'prompt'", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise PromptError(
            "'prompt' must be a string, a list of token ids, or a non-empty batch of those",
            "prompt",
        )
    first = prompt[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return _token_list(prompt, "prompt")
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise PromptError("a 'prompt' batch must be all strings or all token lists", "prompt")
        return first
    if isinstance(first, list):
        if not all(isinstance(p, list) for p in prompt):
            raise PromptError("a 'prompt' batch must be all strings or all token lists", "prompt")
        if not first:
            raise PromptError("'prompt[0]' is an empty token list", "prompt")
        return _token_list(first, "prompt[0]")
    raise PromptError(
        "'prompt' must be a string, a list of token ids, or a batch of those", "prompt"
    )


def completion_prompt_ids(tok: EngineTokenizer | None, body: Mapping[str, Any]) -> list[int]:
    """Engine prompt ids of a completions body (PromptError; UnsupportedPrompt without tok)."""
    prompt = completion_prompt(body)
    if isinstance(prompt, list):
        return _truncate(prompt, body)
    if tok is None:
        raise UnsupportedPrompt("no tokenizer for this model")
    add_special = body.get("add_special_tokens", True)
    ids = tok.chat.encode(prompt, add_special_tokens=add_special is not False)
    return _truncate(ids, body)


def check_messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The ``messages`` of a chat body, shape-checked (PromptError)."""
    messages = body.get("messages")
    if messages is None:
        raise PromptError("missing required field 'messages'", "messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptError(f"messages[{i}] must be an object", "messages")
        if not isinstance(m.get("role"), str):
            raise PromptError(f"messages[{i}].role must be a string", "messages")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise PromptError(f"messages[{i}].content must be a string or a list", "messages")
    return messages


def _normalize(messages: list[Mapping[str, Any]], parts_format: bool) -> list[dict[str, Any]]:
    """Messages as the template sees them (content joined or passed through, tool args parsed)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = dict(m)
        content = msg.get("content")
        if isinstance(content, str) and parts_format:
            msg["content"] = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            texts: list[str] = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                    continue
                if not isinstance(part, dict):
                    raise UnsupportedPrompt("a content part is not an object")
                kind = part.get("type", "text")
                if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
                    raise UnsupportedPrompt(f"content part of type {kind!r}")
                texts.append(part["text"])
            msg["content"] = (
                [{"type": "text", "text": t} for t in texts] if parts_format else "\n".join(texts)
            )
        calls = msg.get("tool_calls")
        if msg.get("role") == "assistant" and isinstance(calls, list):
            if not calls:
                msg.pop("tool_calls")  # an empty list renders as a plain assistant turn
            else:
                msg["tool_calls"] = [_parse_arguments(c) for c in calls]
        out.append(msg)
    return out


def _parse_arguments(call: Any) -> Any:
    """Tool-call ``arguments`` as an object for the template (invalid/non-object JSON -> {})."""
    call = copy.deepcopy(call)
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict):
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                parsed = None
            fn["arguments"] = parsed if isinstance(parsed, dict) else {}
        elif not args:
            fn["arguments"] = {}
    return call


def render_chat(tok: EngineTokenizer, body: Mapping[str, Any]) -> str:
    """The prompt text the engine renders for a chat body (PromptError / UnsupportedPrompt)."""
    return _render(tok, body, check_messages(body))


def _render(
    tok: EngineTokenizer, body: Mapping[str, Any], messages: list[Mapping[str, Any]]
) -> str:
    """``render_chat`` over already shape-checked ``messages``."""
    if not tok.chat.has_chat_template:
        raise UnsupportedPrompt("the model has no chat template")
    chat = _normalize(messages, tok.content_parts)
    cont = body.get("continue_final_message") is True
    if cont:
        last = chat[-1]
        content = last.get("content")
        if isinstance(content, str):
            last["content"] = content + _SENTINEL
        elif isinstance(content, list) and content:
            content[-1]["text"] = content[-1]["text"] + _SENTINEL
        else:
            raise UnsupportedPrompt("continue_final_message without final message text")
    kwargs: dict[str, Any] = {}
    extra = body.get("chat_template_kwargs")
    if isinstance(extra, dict):
        kwargs.update(extra)
    kwargs.update(
        messages=chat,
        add_generation_prompt=body.get("add_generation_prompt", True) is not False,
        tools=body.get("tools") if isinstance(body.get("tools"), list) else None,
        documents=body.get("documents") if isinstance(body.get("documents"), list) else None,
    )
    try:
        rendered = tok.chat.render_template(**kwargs)
    except Exception as e:  # raise_exception() in the template, or any render failure
        raise UnsupportedPrompt(f"chat template failed: {e}") from e
    if cont:
        at = rendered.rfind(_SENTINEL)
        if at < 0:
            raise UnsupportedPrompt("the template dropped the final message")
        rendered = rendered[:at]
    return rendered


def chat_prompt_ids(tok: EngineTokenizer | None, body: Mapping[str, Any]) -> list[int]:
    """Engine prompt ids of a chat body (PromptError; UnsupportedPrompt without a template)."""
    messages = check_messages(body)
    if tok is None:
        raise UnsupportedPrompt("no tokenizer for this model")
    text = _render(tok, body, messages)
    add_special = body.get("add_special_tokens", False) is True
    return _truncate(tok.chat.encode(text, add_special_tokens=add_special), body)
