"""RenderTemplate through a real gRPC client (contract-and-index.md §5.15)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferencecache import fingerprint
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.tokenize import load_tokenizer_dir
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from tests.tokenize.tinytok import write_model

TENANT = "acme"
GREETING = "You are a careful assistant for ACME. Answer in English. Be brief and exact.\n"


def write(root: Path, tenant: str, name: str, text: str) -> Path:
    d = root / tenant if tenant else root
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{name}.j2"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.fixture
def tdir(tmp_path: Path) -> Path:
    root = tmp_path / "templates"
    write(root, TENANT, "support", GREETING + "Question: {{ question }}\n")
    return root


@pytest.fixture
def srv(tdir: Path) -> Iterator[RunningServer]:
    with running_server(template_dir=tdir) as s:
        yield s


def render(
    s: RunningServer, ref: str, tenant: str = TENANT, **variables: str
) -> pb.RenderTemplateResponse:
    resp: pb.RenderTemplateResponse = s.stub().RenderTemplate(
        pb.RenderTemplateRequest(template_ref=ref, tenant_id=tenant, variables=variables),
        timeout=10,
    )
    return resp


def test_c5_15_01_render_with_variables(srv: RunningServer) -> None:
    r = render(srv, "support", question="What is 2+2?")
    assert r.reason_code == "OK"
    assert r.rendered_prompt == (GREETING + "Question: What is 2+2?").encode()
    assert r.tenant_namespace == TENANT.encode()
    assert len(r.template_revision) == 16


def test_c5_15_02_stable_prefix_hash_shared_across_variables(srv: RunningServer) -> None:
    a = render(srv, "support", question="one")
    b = render(srv, "support", question="a completely different question")
    assert a.rendered_prompt != b.rendered_prompt
    assert len(a.stable_prefix_hash) == 8
    assert a.stable_prefix_hash == b.stable_prefix_hash
    # without a tokenizer for the template's model: the chain of the stable part's UTF-8 bytes
    hashes, _ = fingerprint.chain(list((GREETING + "Question: ").encode()), 16)
    assert a.stable_prefix_hash == hashes[-1]


def test_c5_15_02_stable_prefix_hash_uses_the_models_tokenizer(tmp_path: Path) -> None:
    tok_dir = tmp_path / "tok"
    tok = write_model(tok_dir, "org/tiny")
    tokenizers = load_tokenizer_dir(tok_dir)
    root = tmp_path / "templates"
    stable = "the quick brown fox jumps over the lazy dog " * 6
    write(root, TENANT, "fox", "{# model: org/tiny #}" + stable + "{{ tail }}")
    with running_server(template_dir=root, text_tokenizers=tokenizers) as s:
        a = render(s, "fox", tail="x y z")
        b = render(s, "fox", tail="something else")
    assert a.reason_code == b.reason_code == "OK"
    assert a.rendered_prompt == (stable + "x y z").encode()
    ids = tok.encode(stable, add_special_tokens=True).ids[:-1]
    hashes, _ = fingerprint.chain(ids, 16)
    assert hashes, "the test prefix must span a block"
    assert a.stable_prefix_hash == b.stable_prefix_hash == hashes[-1]
    # and it is not the byte fingerprint
    assert a.stable_prefix_hash != fingerprint.chain(list(stable.encode()), 16)[0][-1]


def test_c5_15_03_short_stable_part_has_empty_hash(tmp_path: Path) -> None:
    root = tmp_path / "t"
    write(root, TENANT, "short", "Hi {{ name }}")
    with running_server(template_dir=root) as s:
        r = render(s, "short", name="Bo")
    assert (r.reason_code, r.rendered_prompt, r.stable_prefix_hash) == ("OK", b"Hi Bo", b"")


def test_c5_15_04_template_not_found(srv: RunningServer, tdir: Path) -> None:
    assert render(srv, "nope").reason_code == "TEMPLATE_NOT_FOUND"
    # tenants are isolated: another tenant does not see acme's template
    assert render(srv, "support", tenant="other", question="q").reason_code == "TEMPLATE_NOT_FOUND"
    # refs and tenants never name paths outside the directory
    (tdir.parent / "secret.j2").write_text("top secret", encoding="utf-8")
    for ref, tenant in (("../secret", TENANT), ("secret", ".."), ("..", TENANT),
                        ("support/../../secret", TENANT), ("", TENANT)):  # fmt: skip
        r = render(srv, ref, tenant=tenant)
        assert r.reason_code == "TEMPLATE_NOT_FOUND", (ref, tenant)
        assert r.rendered_prompt == b""


def test_c5_15_04_no_template_dir_is_not_found() -> None:
    with running_server() as s:
        assert render(s, "support").reason_code == "TEMPLATE_NOT_FOUND"


@pytest.mark.parametrize(
    "source",
    [
        "{{ missing }}",  # strict undefined
        "{% include '/etc/passwd' %}",  # no file access
        "{% extends 'base.j2' %}",
        "{% import 'support.j2' as s %}{{ s }}",
        "{{ ''.__class__.__mro__ }}",  # no attribute access
        "{{ question.upper() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ 'x' * 2000000 }}",  # a bound on repetition
        "{% for i in range(100000) %}{{ 'y' * 20 }}{% endfor %}",  # output bound
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",  # recursion
        "{{ 2 ** 100000 }}",
        "{% if %}",  # syntax error
    ],
)
def test_c5_15_05_render_errors(tmp_path: Path, source: str) -> None:
    root = tmp_path / "t"
    write(root, TENANT, "bad", source)
    write(root, TENANT, "good", "ok {{ question }}")
    with running_server(template_dir=root) as s:
        r = render(s, "bad", question="q")
        assert r.reason_code == "RENDER_ERROR"
        assert r.rendered_prompt == b""
        assert r.template_revision  # the revision still names the bad content
        assert render(s, "good", question="q").rendered_prompt == b"ok q"  # server unharmed


def test_c5_15_05_loop_attributes_and_filters_still_work(tmp_path: Path) -> None:
    root = tmp_path / "t"
    write(root, TENANT, "loop", "{% for c in word %}{{ loop.index }}{{ c|upper }}{% endfor %}")
    with running_server(template_dir=root) as s:
        r = render(s, "loop", word="ab")
    assert (r.reason_code, r.rendered_prompt) == ("OK", b"1A2B")


def test_c5_15_06_revision_follows_content_and_file_reloads(srv: RunningServer, tdir: Path) -> None:
    before = render(srv, "support", question="q")
    path = tdir / TENANT / "support.j2"
    path.write_text("New preamble. {{ question }}", encoding="utf-8")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a visible mtime change
    after = render(srv, "support", question="q")
    assert after.rendered_prompt == b"New preamble. q"
    assert after.template_revision != before.template_revision
    # same content, same revision (content-derived, not time-derived)
    path.write_text(GREETING + "Question: {{ question }}\n", encoding="utf-8")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000))
    again = render(srv, "support", question="q")
    assert again.template_revision == before.template_revision
    path.unlink()
    assert render(srv, "support", question="q").reason_code == "TEMPLATE_NOT_FOUND"


def test_c5_15_07_reason_codes_are_counted(srv: RunningServer) -> None:
    render(srv, "support", question="q")
    render(srv, "nope")
    reg = srv.metrics.registry
    for code in ("OK", "TEMPLATE_NOT_FOUND"):
        v = reg.get_sample_value(
            "inferencecache_render_template_calls_total", {"reason_code": code}
        )
        assert v == 1.0, code


def test_c5_15_07_a_handler_exception_is_render_error(
    srv: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = srv.server.templates._registry  # type: ignore[union-attr]
    assert registry is not None

    def broken(tenant: str, ref: str) -> None:
        raise RuntimeError("registry broke")

    monkeypatch.setattr(registry, "get", broken)
    r = render(srv, "support", question="q")
    assert r == pb.RenderTemplateResponse(reason_code="RENDER_ERROR")
    v = srv.metrics.registry.get_sample_value(
        "inferencecache_server_dropped_inputs_total",
        {"loop": "RenderTemplate", "reason": "internal"},
    )
    assert v == 1.0
