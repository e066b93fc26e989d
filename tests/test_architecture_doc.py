"""docs/ARCHITECTURE.md names every module of the package (its "Every module" list), and no module that is gone;
no document a user reads tells its story by work session."""
from __future__ import annotations

import re

from conftest import ROOT

PACKAGE = ROOT / "hvdlite"
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def test_every_module_is_named_in_the_architecture_doc() -> None:
    text = DOC.read_text()
    modules = sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py"))
    assert len(modules) > 100
    missing = [m for m in modules if f"`{m}`" not in text]
    assert not missing, f"docs/ARCHITECTURE.md's 'Every module' list lacks {missing}: add a line for each"
    listed = re.findall(r"^- `([\w/]+\.py)`:", text.split("## Every module", 1)[1], flags=re.M)
    gone = sorted(set(listed) - set(modules))
    assert not gone, f"docs/ARCHITECTURE.md lists modules that no longer exist: {gone}"
    assert len(listed) == len(set(listed)), "a module is listed twice"


def test_what_a_user_reads_is_by_topic_with_no_session_narrative() -> None:
    """README, docs/ and the benchmarks' READMEs say what is true now; how it came about (work session by work
    session) belongs in HISTORY.md and benchmarks/HISTORY.md."""
    read = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "lab" / "README.md",
            *sorted((ROOT / "docs").glob("*.md"))]
    assert len(read) > 5 and all(path.exists() for path in read)
    # also across a line break ("Earlier\nsessions measured ...")
    story = r"\b[Ss]essions?\s+\d|\b(?:[Ee]arlier|[Pp]revious|[Ll]ast|[Nn]ext)\s+(?:work\s+)?sessions?\b"
    found = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for path in read
             for text in [path.read_text()] for m in re.finditer(story, text)]
    assert not found, "move these to HISTORY.md or benchmarks/HISTORY.md:\n" + "\n".join(found)
