"""docs/ARCHITECTURE.md names every module of the package (its "Every module" list), and no module that is gone."""
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
