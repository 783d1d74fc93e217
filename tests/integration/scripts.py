"""Runs a worker script on a `prophet-tf launch` cluster (one PS), always reaped."""
from __future__ import annotations

import pathlib
import subprocess
import sys

from cluster import ROOT, launch_env, reap_group


def launch_script(script: pathlib.Path, log_path: pathlib.Path, args, *, workers: int = 2,
                  timeout: float = 150.0) -> tuple[int | None, str]:
    """`prophet-tf launch --workers W --ps 1 -- python SCRIPT ARGS`: (exit code or None when
    it timed out, the log's tail)."""
    command = [sys.executable, "-m", "prophet_tf", "launch", "--workers", str(workers),
               "--ps", "1", "--", sys.executable, str(script), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=launch_env(PYTHONFAULTHANDLER="1"), start_new_session=True)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        reap_group(proc)
    return code, log_path.read_text(errors="replace")[-6000:]
