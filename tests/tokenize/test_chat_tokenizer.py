"""Tokenizer loading and chat-template encoding (contract-and-index.md §5.2 step 4 and its loading
rules)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jinja2
import pytest

from inferencecache.tokenize import TokenizerLoadError, TokenizerSet, load_tokenizer_dir
from tests.tokenize.tinytok import CHAT_TEMPLATE, write_model


def test_c5_02_nested_model_ids_load_from_tokenizer_dir(tmp_path: Path) -> None:
    """``model_id`` may contain ``/``: ``<dir>/org/model-a/tokenizer.json`` is "org/model-a"."""
    write_model(tmp_path, "org/model-a")
    write_model(tmp_path, "plain", template=None)
    (tmp_path / "org" / "README").write_text("not a model")
    tokenizers = load_tokenizer_dir(tmp_path)
    assert tokenizers.model_ids == ["org/model-a", "plain"]
    assert tokenizers.has_model("org/model-a")
    assert not tokenizers.has_model("org")
    assert not tokenizers.has_model("org/model-a/../plain")
    assert not tokenizers.has_model("")


def test_linked_model_folders_are_followed_and_link_loops_are_not(tmp_path: Path) -> None:
    """``<dir>/tiny`` may be a link to an engine's model folder (also under two names); a
    link back up the tree is not walked into (no endless loop, no extra model ids)."""
    models = tmp_path / "models"
    write_model(models, "real")
    tokdir = tmp_path / "tok"
    (tokdir / "org").mkdir(parents=True)
    (tokdir / "tiny").symlink_to(models / "real", target_is_directory=True)
    (tokdir / "org" / "alias").symlink_to(models / "real", target_is_directory=True)
    (tokdir / "org" / "loop").symlink_to(tokdir, target_is_directory=True)
    (models / "real" / "up").symlink_to(models, target_is_directory=True)
    tokenizers = load_tokenizer_dir(tokdir)
    assert tokenizers.model_ids == ["org/alias", "tiny"]
    assert tokenizers.encode_chat("tiny", "hi") == tokenizers.encode_chat("org/alias", "hi")


def test_c10_67_one_user_message_with_generation_prompt(tmp_path: Path) -> None:
    """The prompt is rendered as exactly one user message plus the generation prompt."""
    tok = write_model(tmp_path, "m")
    chat = load_tokenizer_dir(tmp_path).get("m")
    assert chat is not None and chat.has_chat_template
    rendered = chat.render("hello world")
    assert rendered == "<s><|user|>\nhello world</s>\n<|assistant|>\n"
    ids = load_tokenizer_dir(tmp_path).encode_chat("m", "hello world")
    assert ids == tok.encode(rendered, add_special_tokens=False).ids
    bos = tok.token_to_id("<s>")
    assert ids[0] == bos and ids.count(bos) == 1


def test_template_owns_special_tokens_even_with_a_bos_post_processor(tmp_path: Path) -> None:
    """The rendered chat already carries BOS; encoding must not add a second one."""
    tok = write_model(tmp_path, "m", with_bos_post_processor=True)
    ids = load_tokenizer_dir(tmp_path).encode_chat("m", "the lazy dog")
    bos = tok.token_to_id("<s>")
    assert bos is not None and ids.count(bos) == 1
    assert tok.encode("x").ids[0] == bos  # the post-processor is really there


def test_model_without_chat_template_encodes_raw_text_with_special_tokens(tmp_path: Path) -> None:
    """Documented choice: no template -> the text as a completion prompt (tokenizer's specials)."""
    tok = write_model(tmp_path, "raw", template=None, with_bos_post_processor=True)
    chat = load_tokenizer_dir(tmp_path).get("raw")
    assert chat is not None and not chat.has_chat_template
    ids = chat.encode_chat("hello world")
    assert ids == tok.encode("hello world").ids
    assert ids[0] == tok.token_to_id("<s>")


def test_named_template_list_uses_default(tmp_path: Path) -> None:
    write_model(
        tmp_path,
        "named",
        template=[
            {"name": "tool_use", "template": "TOOLS {{ messages[0]['content'] }}"},
            {"name": "default", "template": "DEFAULT {{ messages[0]['content'] }}"},
        ],
    )
    chat = load_tokenizer_dir(tmp_path).get("named")
    assert chat is not None
    assert chat.render("x") == "DEFAULT x"


def test_sibling_chat_template_file_is_used_when_config_has_none(tmp_path: Path) -> None:
    write_model(tmp_path, "split", template=None, template_file="FILE {{ messages[0].content }}")
    chat = load_tokenizer_dir(tmp_path).get("split")
    assert chat is not None and chat.render("abc") == "FILE abc"


def test_template_sees_special_tokens_and_tojson_keeps_unicode(tmp_path: Path) -> None:
    template = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ messages | tojson }}"
    write_model(tmp_path, "j", template=template)
    chat = load_tokenizer_dir(tmp_path).get("j")
    assert chat is not None
    out = chat.render("héllo")
    assert out.startswith("<s>|</s>|<unk>|")
    assert json.loads(out.split("|", 3)[3]) == [{"role": "user", "content": "héllo"}]
    assert "héllo" in out


def test_template_runs_in_a_sandbox(tmp_path: Path) -> None:
    """A hostile template cannot reach Python internals; the render raises (lookup fails open)."""
    write_model(tmp_path, "evil", template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    tokenizers = load_tokenizer_dir(tmp_path)
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizers.encode_chat("evil", "x")


def test_raise_exception_in_template_is_an_error(tmp_path: Path) -> None:
    write_model(tmp_path, "strict", template="{{ raise_exception('no system role') }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        load_tokenizer_dir(tmp_path).encode_chat("strict", "x")


def test_unknown_model_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        TokenizerSet().encode_chat("nope", "x")


def test_bad_tokenizer_file_names_the_file_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError) as e:
        load_tokenizer_dir(tmp_path)
    assert "broken/tokenizer.json" in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_template_syntax_names_the_model(tmp_path: Path) -> None:
    write_model(tmp_path, "org/bad", template="{% for %}")
    with pytest.raises(TokenizerLoadError, match="org/bad"):
        load_tokenizer_dir(tmp_path)


def test_bad_config_json_is_a_load_error(tmp_path: Path) -> None:
    write_model(tmp_path, "cfg")
    (tmp_path / "cfg" / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerLoadError, match=r"tokenizer_config\.json"):
        load_tokenizer_dir(tmp_path)


def test_missing_dir_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="not a readable directory"):
        load_tokenizer_dir(tmp_path / "absent")


def test_concurrent_encodes_agree(tmp_path: Path) -> None:
    write_model(tmp_path, "m", template=CHAT_TEMPLATE)
    tokenizers = load_tokenizer_dir(tmp_path)
    texts = [f"the quick brown fox {i}" for i in range(64)]
    expected = [tokenizers.encode_chat("m", t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: tokenizers.encode_chat("m", t), texts))
    assert got == expected
