"""Every relative link and #anchor in the README, CONTRIBUTING.md, docs/ and the
examples' READMEs resolves.

Anchors are GitHub's: a heading's text, lower-cased, without punctuation,
spaces as hyphens, and -1, -2, ... for repeated headings. Links and headings
inside code (fenced blocks, `inline code`) are not links or headings.
"""
import pathlib
import re
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md",
               *(ROOT / "docs").glob("*.md"), *(ROOT / "docs").glob("records/*.md"),
               *(ROOT / "examples").glob("*/README.md")])

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code blanked out
    (line numbers kept)."""
    lines, fence = [], None
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            lines.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            lines.append("")
            continue
        lines.append(re.sub(r"(`+)(.+?)\1", lambda c: " " * len(c.group(0)), line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w: letters, digits and _ of any script
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """The anchors of a Markdown file's headings (code blocks left out)."""
    seen: dict[str, int] = {}
    out = set()
    raw = path.read_text().split("\n")
    for i, line in enumerate(_prose(path.read_text())):
        if not re.match(r"^#{1,6} ", line):
            continue
        base = slug(raw[i].lstrip("#").strip().rstrip("#").strip())
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in the file's prose."""
    return [(i + 1, m.group(1)) for i, line in enumerate(_prose(path.read_text()))
            for m in _LINK.finditer(line)]


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def broken(path: pathlib.Path) -> list[str]:
    """What does not resolve in one file, one message per link."""
    out = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / urllib.parse.unquote(file_part)).resolve() if file_part else path
        where = f"{_name(path)}:{line}: {target}"
        if not dest.exists():
            out.append(f"{where}: no such file")
        elif anchor:
            if dest.suffix != ".md":
                out.append(f"{where}: an anchor into a file that is not Markdown")
            elif urllib.parse.unquote(anchor) not in anchors(dest):
                out.append(f"{where}: no heading with this anchor in {_name(dest)}")
    return out


def test_the_documents_exist():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "CONTRIBUTING.md", "docs/guide.md", "docs/design.md",
            "docs/benchmarks.md"} <= names


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(path):
    assert broken(path) == []


def test_the_readme_stays_a_short_guide():
    # The README is for users; everything else has a page in docs/.
    assert len((ROOT / "README.md").read_text().split("\n")) <= 420


def test_anchors_are_githubs(tmp_path):
    assert slug("What `fit` computes") == "what-fit-computes"
    assert slug("tf_keras (Keras 2)") == "tf_keras-keras-2"
    assert slug("The transport budget: what this machine carries") == (
        "the-transport-budget-what-this-machine-carries")
    assert slug("What keeps a turn going, and a fair queue at each host") == (
        "what-keeps-a-turn-going-and-a-fair-queue-at-each-host")
    assert slug("Record of 2026-12-01: Prophet's partition size") == (
        "record-of-2026-12-01-prophets-partition-size")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Run\n\n```sh\n# not a heading\n```\n\n## Run\n\n"
                    "[ok](#run-1) [no](#not-a-heading) `[code](#nowhere)` "
                    "[file](other.md#x) [web](https://example.com/#y) ![img](pic.png)\n")
    (tmp_path / "other.md").write_text("# Y\n")
    (tmp_path / "pic.png").write_bytes(b"")
    assert anchors(page) == {"title", "run", "run-1"}
    assert [t for _, t in links(page)] == ["#run-1", "#not-a-heading", "other.md#x",
                                           "https://example.com/#y", "pic.png"]
    assert [m.split(": ", 1)[1] for m in broken(page)] == [
        "#not-a-heading: no heading with this anchor in " + str(page),
        "other.md#x: no heading with this anchor in " + str(tmp_path / "other.md")]
