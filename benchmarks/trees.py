"""Running another checkout's code beside this one's, for before/after runs
in one benchmark (``--baseline-root``): which commit a tree holds, and a check
that processes started in it import its prophet_tf."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

__all__ = ["commit", "check_imports_from"]


def commit(root: pathlib.Path) -> str | None:
    """The checked-out commit of ``root`` (with ``+`` if its tree has changes), or None."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, check=False).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def check_imports_from(root: pathlib.Path, env: dict | None = None) -> None:
    """Fails unless a process started in ``root`` (its working directory, which
    ``python -m`` puts before PYTHONPATH) imports ``root``'s prophet_tf, not this
    tree's nor the installed one."""
    found = subprocess.run([sys.executable, "-c", "import prophet_tf; print(prophet_tf.__file__)"],
                           env=dict(os.environ, PYTHONPATH=str(root), **(env or {})), cwd=root,
                           capture_output=True, text=True, check=True).stdout.strip()
    expected = root / "prophet_tf" / "__init__.py"
    if pathlib.Path(found).resolve() != expected.resolve():
        raise RuntimeError(f"processes run from {root} would import {found}, not {expected}")
