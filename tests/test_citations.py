"""The contract lives in the repo: code, tests and docs cite the project's own pages by their headings
(docs/domain.md, "The truth"), never a file outside the checkout, and every heading cited exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".sh", ".json"}
SKIP = {".git", ".venv", ".test-cache", "artifacts", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache"}
#: a page named with a quoted heading after it: docs/domain.md, "The truth" (the comma optional)
CITATION = re.compile(r'([\w./-]+\.md),? "([^"\n]+)"')


def repo_files():
    for path in sorted(ROOT.rglob("*")):
        if path.suffix in TEXT and path.is_file() and not SKIP.intersection(path.relative_to(ROOT).parts):
            yield path


def headings(page: Path) -> set[str]:
    """A page's headings, each also without a trailing parenthesis (``Query/key traces (`kvsim-qk`, version 1)``
    is cited as "Query/key traces")."""
    found = set()
    for line in page.read_text().splitlines():
        if m := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line):
            found |= {m.group(1), re.sub(r"\s*\([^()]*\)$", "", m.group(1))}
    return found


def test_nothing_cites_the_contract_outside_the_checkout():
    outside = "DOMAIN" + ".md"  # spelt in two parts, so this file does not cite it either
    citing = [f"{p.relative_to(ROOT)}:{i}" for p in repo_files()
              for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside in line]
    assert not citing, f"cite docs/domain.md by its heading instead: {citing}"


def test_every_cited_heading_exists_on_the_page_it_names():
    bad, seen = [], 0
    for path in repo_files():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for page_name, heading in CITATION.findall(line):
                page = next((p for p in (ROOT / page_name, path.parent / page_name) if p.is_file()), None)
                where = f"{path.relative_to(ROOT)}:{i}"
                if page is None:
                    bad.append(f'{where}: {page_name} does not exist')
                elif heading not in headings(page):
                    bad.append(f'{where}: {page_name} has no heading "{heading}"')
                seen += 1
    assert seen >= 10, "the citation pattern no longer finds the repo's citations"
    assert not bad, "\n".join(bad)
