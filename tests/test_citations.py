"""Citations of the authors' code: line numbers live in docs/arms.md and docs/models.md, never in maskbench/.

Line numbers of another repository drift as it moves on, and a docstring that cites them is checked by nobody. The
code names the repository and file it follows and says what it takes from it; the pages cite the lines, in one
place, where this test checks their form: an allowed repository, a file path with an extension, ranges that run
forward. (The lines themselves are checked against the authors' code when a page is revised, not here: the tests
run offline.)
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "maskbench"
PAGES = [ROOT / "docs" / "arms.md", ROOT / "docs" / "models.md"]

# The repositories maskbench follows, as docs/arms.md spells them.
ALLOWED_REPOS = {
    "Anima-Lab/MaskDiT",
    "snap-research/Sprint",
    "CompVis/tread",
    "sihyun-yu/REPA",
    "sail-sg/ScaleLong",
    "OpenSparseLLMs/Skip-DiT",
    "SonyResearch/micro_diffusion",
}

_EXT = r"(?:py|ya?ml|md|toml|json|cfg|sh|txt|ipynb)"
# A file name followed by a line number: "maskdit.py 195-213", "`dit.py` 239", "SPRINT_256.yaml:29", "sit.py#L420",
# with the number on the next line of a docstring or comment too.
CITED_LINES = re.compile(rf"[\w./-]*\w\.{_EXT}`?(?:#L|:|\s)\s*\d+")

# In the pages: owner/repo [(commit)] `path` lines, e.g. "CompVis/tread (fccf77c) `configs/model/tread.yaml` 10-13".
_LINES = r"\d+(?:-\d+)?(?:(?:, | and )\d+(?:-\d+)?)*"
PAGE_CITATION = re.compile(
    r"(?<![\w./`-])(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
    r"(?: \((?:at |commit )?[0-9a-f]{7,40}\))?"
    rf" `?(?P<path>[^`\s|]+?)`?[ :]\s*(?P<lines>{_LINES})(?![\w.-])"
)
# A line range, as the pages write one: bare integers joined by an ASCII hyphen (not part of a date or a decimal;
# a numeric range that is not a citation is written with an en dash, "12–20 px").
LINE_RANGE = re.compile(r"(?<![-\d.\w])(\d+)-(\d+)(?![-\d.\w])")


def _comments(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each comment; consecutive full-line comments are joined into one."""
    found: list[tuple[int, str]] = []
    last_line = -1
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        text = token.string.lstrip("#").strip()
        full_line = not token.line[:token.start[1]].strip()
        if full_line and found and last_line == token.start[0] - 1:
            found[-1] = (found[-1][0], f"{found[-1][1]}\n{text}")
        else:
            found.append((token.start[0], text))
        last_line = token.start[0] if full_line else -1
    return found


def _strings(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each docstring and other bare string statement."""
    return [(node.lineno, node.value.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)]


def cited_lines(source: str) -> list[tuple[int, str]]:
    """(line, excerpt) of every file-and-line citation in the comments and docstrings of `source`."""
    hits = []
    for start, text in _comments(source) + _strings(source):
        for match in CITED_LINES.finditer(text):
            line = start + text[:match.start()].count("\n")
            hits.append((line, " ".join(match.group().split())))
    return sorted(hits)


def page_citations(text: str) -> list[tuple[int, str, str, str]]:
    """(line, repo, path, lines) of every `owner/repo path lines` citation in a page."""
    return [(text[:m.start()].count("\n") + 1, m["repo"], m["path"], m["lines"])
            for m in PAGE_CITATION.finditer(text)]


def test_cited_lines_pattern() -> None:
    source = '''"""MaskDiT (Anima-Lab/MaskDiT models/maskdit.py
    538-545), SPRINT (sit.py 420, 509), REPA (train.py 48-51), `dit.py` 239, SPRINT_256.yaml:29-31."""
x = 1  # MaskDiT zeroes it (maskdit.py 403-408)
# U-ViT's layout (sail-sg/ScaleLong libs/uvit.py
# 182-196)
"""No citation: models/maskdit.py; docs/arms.md cites the lines. 12 blocks, 2 heads."""
'''
    assert [line for line, _ in cited_lines(source)] == [1, 2, 2, 2, 2, 3, 4]


def test_no_module_cites_line_numbers() -> None:
    """maskbench/ names the repository and file it follows; docs/arms.md (or docs/models.md) cites the lines."""
    found = [f"{path.relative_to(ROOT)}:{line}: {excerpt}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for line, excerpt in cited_lines(path.read_text(encoding="utf-8"))]
    assert not found, ("line numbers of a file cited in maskbench/ (move them to docs/arms.md, or docs/models.md for "
                       "a preset, and keep the repository and file in the code):\n" + "\n".join(found))


def test_page_citation_pattern() -> None:
    text = ("| sail-sg/ScaleLong `libs/uvit.py` 126-128 (fusion) | CompVis/tread (fccf77c) `configs/model/tread.yaml` "
            "10-13 (ratio) |\nsnap-research/Sprint `src/models/sit.py` 420 and 509, not DiT-XL/2's 28 blocks")
    assert page_citations(text) == [(1, "sail-sg/ScaleLong", "libs/uvit.py", "126-128"),
                                    (1, "CompVis/tread", "configs/model/tread.yaml", "10-13"),
                                    (2, "snap-research/Sprint", "src/models/sit.py", "420 and 509")]


def test_page_citations_are_well_formed() -> None:
    """Each `owner/repo path lines` citation names a followed repository and a file with an extension; every line
    range on the pages runs forward."""
    bad, repos = [], set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT)
        for line, repo, path, lines in page_citations(text):
            repos.add(repo)
            if repo not in ALLOWED_REPOS:
                bad.append(f"{name}:{line}: {repo} is not a repository maskbench follows ({sorted(ALLOWED_REPOS)})")
            if not re.search(r"\.\w+$", path):
                bad.append(f"{name}:{line}: {repo} {path!r} is not a file path with an extension")
            for first, last in re.findall(r"(\d+)-(\d+)", lines):
                if int(first) > int(last):
                    bad.append(f"{name}:{line}: {repo} {path} {first}-{last} runs backwards")
        for match in LINE_RANGE.finditer(text):
            if int(match[1]) > int(match[2]):
                bad.append(f"{name}:{text[:match.start()].count(chr(10)) + 1}: range {match[0]} runs backwards")
    assert not bad, "\n".join(bad)
    # The pattern still reads the pages: the literature arms cite at least these.
    assert {"Anima-Lab/MaskDiT", "snap-research/Sprint", "CompVis/tread", "sihyun-yu/REPA",
            "sail-sg/ScaleLong", "OpenSparseLLMs/Skip-DiT"} <= repos, sorted(repos)
