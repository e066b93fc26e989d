"""The test tiers: every test file has exactly one (tests/conftest.py's TIERS), the tiers are the markers
registered in setup.cfg, and selecting a tier with -m selects exactly its files' tests."""
from __future__ import annotations

import configparser
import subprocess
import sys

from conftest import ROOT, TIER_NAMES, tier_of

TESTS = ROOT / "tests"


def test_every_test_file_has_one_tier_and_the_tiers_are_registered() -> None:
    files = sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "parallel").glob("test_*.py"))
    assert len(files) > 30
    tiers = {path.relative_to(TESTS).as_posix(): tier_of(path) for path in files}  # raises for a file with none
    assert set(tiers.values()) == set(TIER_NAMES), tiers  # every tier has files
    assert all(tier == "multi_rank" for name, tier in tiers.items() if name.startswith("parallel/"))
    assert tiers["test_core_unit.py"] == "unit" and tiers["test_slurm.py"] == "cluster"
    assert tiers["test_launch_cli.py"] == "launcher" and tiers["test_torch_zero_example.py"] == "examples"
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    registered = [line.split(":")[0].strip() for line in config.get("tool:pytest", "markers").splitlines()
                  if line.strip()]
    assert sorted(registered) == sorted(TIER_NAMES)


def test_selecting_a_tier_selects_its_files_tests() -> None:
    """Collected tests carry their file's tier: -m picks one file of a pair and not the other."""
    def collected(tier: str) -> set[str]:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "-m", tier, "tests/test_reduce_scaling.py", "tests/test_tiers.py"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    assert collected("unit") == {"tests/test_reduce_scaling.py"}
    assert collected("static") == {"tests/test_tiers.py"}
    assert collected("unit or static") == {"tests/test_reduce_scaling.py", "tests/test_tiers.py"}
