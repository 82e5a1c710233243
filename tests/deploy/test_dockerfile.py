"""Static facts of the image recipe that the (slower) image tests rely on."""

from __future__ import annotations

import re
import tomllib

from inferencecache.accelerators import MODULES
from tests.deploy.manifests import REPO


def test_the_image_build_imports_every_compiled_accelerator() -> None:
    """The Dockerfile's build stage imports ``accelerators.MODULES`` under
    INFERENCECACHE_REQUIRE_NATIVE: that list must be every ext-module pyproject builds."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    built = {m["name"] for m in project["tool"]["setuptools"]["ext-modules"]}
    assert set(MODULES) == built and len(MODULES) == len(built)
    assert "a.MODULES" in (REPO / "Dockerfile").read_text()


def test_dockerfile_defaults_and_runtime_user() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm$", text, re.M)
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["inferencecache"\]$', text, re.M)
    assert text.count("FROM ${BASE_IMAGE}") == 2  # one base: the venv's interpreter path holds
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".git", ".venv", "**/*.so", "tests"):
        assert path in ignored
