"""Every ``§`` citation in the repository resolves to a section of ``docs/spec/``.

A citation names its file on the same line, before the ``§``: ``contract-and-index.md §5.4``,
``engine-events-and-subscriber.md §3.2`` (later ``§``s on the line refer to the same file, as in
``contract-and-index.md §5.1-§5.3, §5.8``). Inside a spec file a bare ``§`` is that file, unless
it directly continues a citation of the other file (``engine-events-and-subscriber.md §5, §7``).
The
section must be a heading of the file (``## 5.`` / ``### 5.4``), and ``§10 item 8`` /
``§13 items 74–77`` must name numbered items of that section. Test names that pin an item
(``test_c10_08_*``: contract §10 item 8; ``test_s13_24_*``: subscriber §13 item 24;
``test_c5_02_*``: contract §5.2) must name existing ones too.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "spec"
SPEC_FILES = ("contract-and-index.md", "engine-events-and-subscriber.md")
SCANNED = ("src", "tests", "bench", "scripts", "docs", "README.md")
SUFFIXES = {".py", ".pyi", ".c", ".h", ".md", ""}

_FILE = re.compile("|".join(re.escape(f) for f in SPEC_FILES))
_REF = re.compile(r"§(\d+(?:\.\d+)*)(?:\s+items?\s+(\d+)(?:\s*[–-]\s*(\d+))?)?")
_TEST = re.compile(r"def (test_([cs])(\d+)_(\d+))_")
_CONTINUES = re.compile(r"^[\s,;/()`]*(?:(?:and|or|to|items?|\d+|[–-])[\s,;/()`]*)*$")


@cache
def sections(name: str) -> tuple[frozenset[str], dict[str, frozenset[int]]]:
    """(section numbers of ``docs/spec/<name>``'s headings, numbered items per top section)."""
    heads: set[str] = set()
    items: dict[str, set[int]] = {}
    current = ""
    for line in (SPEC / name).read_text().splitlines():
        m = re.match(r"#{2,4} (\d+(?:\.\d+)*)\.? ", line)
        if m:
            heads.add(m.group(1))
            current = m.group(1).split(".")[0]
            continue
        m = re.match(r"(\d+)\. ", line)
        if m and current:
            items.setdefault(current, set()).add(int(m.group(1)))
    return frozenset(heads), {k: frozenset(v) for k, v in items.items()}


def problems_of(path: Path) -> list[str]:
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    own = path.name if path.parent == SPEC else None
    out: list[str] = []
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        refs = list(_REF.finditer(line))
        for m in refs:
            named = [f for f in _FILE.finditer(line, 0, m.start())]
            spec = named[-1].group(0) if named else own
            if named and own is not None:  # a spec file: does the name still apply here?
                between = line[named[-1].end() : m.start()]
                for r in refs:
                    between = between.replace(r.group(0), " ")
                if not _CONTINUES.match(between):
                    spec = own
            where = f"{rel}:{lineno}: §{m.group(1)}"
            if spec is None:
                out.append(f"{where} names no spec file (write e.g. contract-and-index.md §N)")
                continue
            heads, items = sections(spec)
            if m.group(1) not in heads:
                out.append(f"{where}: no such section in {spec}")
                continue
            if m.group(2):
                last = int(m.group(3) or m.group(2))
                have = items.get(m.group(1), frozenset())
                missing = [n for n in range(int(m.group(2)), last + 1) if n not in have]
                if missing:
                    out.append(f"{where} item {missing[0]}: no such item in {spec}")
        for m in _TEST.finditer(line):
            spec = SPEC_FILES[0] if m.group(2) == "c" else SPEC_FILES[1]
            heads, items = sections(spec)
            top, num = m.group(3), int(m.group(4))
            if top in items and len(items[top]) > 20:  # §10 / §13: numbered acceptance items
                ok = num in items[top]
            else:
                ok = f"{top}.{num}" in heads
            if not ok:
                out.append(f"{rel}:{lineno}: {m.group(1)} pins nothing in {spec}")
    return out


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for entry in SCANNED:
        p = ROOT / entry
        if p.is_file():
            files.append(p)
            continue
        for f in sorted(p.rglob("*")):
            if f.is_file() and f.suffix in SUFFIXES and "v1alpha1" not in f.parts:
                files.append(f)
    return files


def test_every_spec_citation_resolves() -> None:
    me = Path(__file__).resolve()
    problems = [p for f in scanned_files() if f != me for p in problems_of(f)]
    assert problems == [], "\n".join(problems)


def test_the_checker_catches_bad_citations(tmp_path: Path) -> None:
    """The rules above can fail: an unnamed file, a missing section, a missing item."""
    bad = tmp_path / "probe.py"
    bad.write_text(
        "# §5.4 without a file\n"
        "# contract-and-index.md §5.99\n"
        "# engine-events-and-subscriber.md §13 item 999\n"
        "# contract-and-index.md §5.4, §5.5 and engine-events-and-subscriber.md §3.2\n"
        "def test_c10_999_nothing(): ...\n"
    )
    got = problems_of(bad)
    assert len(got) == 4, got
    assert "names no spec file" in got[0]
    assert "no such section" in got[1]
    assert "item 999" in got[2]
    assert "pins nothing" in got[3]
