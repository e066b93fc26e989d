"""The user's line that submitted an op: captured on a memo miss, never in steady state; shown in errors."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import sysconfig
from typing import Any, Iterable, Optional

#: Packages whose frames are never the user's line: hvdlite itself and the frameworks that call into it
#: (a gradient hook runs under torch.autograd, a Keras callback under keras' training loop).
FRAMEWORK_PACKAGES = ("hvdlite", "torch", "tensorflow", "keras", "tf_keras", "lightning", "pytorch_lightning",
                      "lightning_fabric", "numpy", "mpi4py", "horovod")
_REMEMBER_LIMIT = 1 << 16  # code objects and texts remembered; past it the table starts again

Site = tuple[str, int]  # (file name, line)


def _internal_prefixes() -> tuple[str, ...]:
    """Directory prefixes of the framework packages (found without importing them) and of the standard library."""
    prefixes = []
    for package in FRAMEWORK_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            prefixes.append(os.path.join(os.path.realpath(location), ""))
            prefixes.append(os.path.join(os.path.abspath(location), ""))
    return tuple(dict.fromkeys(prefixes))


_PREFIXES = _internal_prefixes()
_STDLIB = tuple(dict.fromkeys(os.path.join(os.path.realpath(sysconfig.get_paths()[key]), "")
                              for key in ("stdlib", "platstdlib")))
_internal_code: dict[int, tuple[Any, bool]] = {}  # id of a code object -> it, whether its frames are skipped


def is_users(filename: str) -> bool:
    """Whether a frame of this file is the user's own (not hvdlite's, a framework's or the standard library's)."""
    if filename.startswith("<"):  # <frozen ...>, <string>: no line a user could open
        return False
    path = os.path.realpath(filename) if os.path.isabs(filename) else os.path.abspath(filename)
    return not path.startswith(_PREFIXES) and not (path.startswith(_STDLIB) and "-packages" + os.sep not in path)


def capture(depth: int = 2) -> Optional[Site]:
    """(file, line) of the innermost frame outside hvdlite, the frameworks and the standard library, from
    ``depth`` frames above this call; None when every frame is internal (e.g. a graph-mode kernel's thread)."""
    frame: Any = sys._getframe(depth)
    internal = _internal_code
    while frame is not None:
        code = frame.f_code
        known = internal.get(id(code))  # (by id: a code object hashes its whole contents at each lookup)
        if known is None:
            if len(internal) >= _REMEMBER_LIMIT:
                internal.clear()
            known = internal[id(code)] = (code, not is_users(code.co_filename))  # (kept: no other takes its id)
        if not known[1]:
            return (code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def show(site: Optional[Site], cwd: Optional[str] = None) -> str:
    """``file:line``, the file relative to the working directory (``cwd``) when it lies below it."""
    if site is None:
        return "an unknown line (no frame outside hvdlite and the frameworks)"
    filename, line = site
    with contextlib.suppress(ValueError):  # (on another drive: Windows)
        rel = os.path.relpath(filename, cwd)
        filename = rel if not rel.startswith(os.pardir) else filename
    return f"{filename}:{line}"


def site_table(requests: Iterable[Any]) -> tuple[list[int], list[str]]:
    """For a full round: each pending request's site as an index into its distinct texts (-1: none), and those."""
    indices: list[int] = []
    texts_sent: list[str] = []
    index_of: dict[Site, int] = {}
    cwd = os.getcwd()
    texts = _texts
    for req in requests:
        site = req.site
        if site is None:
            indices.append(-1)
            continue
        index = index_of.get(site)
        if index is None:
            text = texts.get((cwd, site))
            if text is None:
                if len(texts) >= _REMEMBER_LIMIT:
                    texts.clear()
                text = texts[(cwd, site)] = show(site, cwd)
            index = index_of[site] = len(texts_sent)
            texts_sent.append(text)
        indices.append(index)
    return indices, texts_sent


_texts: dict[tuple[str, Site], str] = {}  # (working directory, site) -> show(site, that directory)


def describe(sites: dict[int, Optional[str]]) -> str:
    """`` Submitted at: rank 0: train.py:12; rank 1: train.py:15.`` (ranks sharing a line grouped)."""
    text = grouped({rank: site or "an unknown line" for rank, site in sites.items()})
    return f" Submitted at: {text}." if text else ""


def grouped(values: dict[int, Any]) -> str:
    """``rank 0: a; ranks 1, 2: b``: each rank's value, the ranks with equal values grouped (error texts)."""
    groups: dict[Any, list[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(value, []).append(rank)
    return "; ".join(f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {value}"
                     for value, ranks in groups.items())
