"""The layering of docs/design.md as a test: `lint-imports` runs the contracts in pyproject.toml.

    .venv/bin/python -m pytest tests/test_layering.py -q

The second test plants an import cycle and a forbidden arrow in a copy of the packages and checks that the
same contracts then fail, so a broken checker cannot pass silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.common import REPO_ROOT

PACKAGES = ("pipeline", "tokenizer", "pretrain")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the packages under `root`, with `root`'s pyproject.toml, importing nothing from here."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--config", str(root / "pyproject.toml"),
                           "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    result = lint_imports(REPO_ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " 0 broken." in result.stdout, result.stdout[-4000:]


def test_a_planted_cycle_and_a_forbidden_arrow_break_them(tmp_path):
    for package in PACKAGES:
        shutil.copytree(REPO_ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "pipeline" / "common.py", "a") as f:         # common <- settings: now a cycle
        f.write("\nfrom pipeline import settings  # planted\n")
    with open(tmp_path / "tokenizer" / "t5.py", "a") as f:            # the tokenizer reaching into pipeline
        f.write("\nimport pipeline.common  # planted\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "No import cycle between the modules of any package BROKEN" in result.stdout, result.stdout[-3000:]
    assert "The tokenizer stands alone BROKEN" in result.stdout, result.stdout[-3000:]
