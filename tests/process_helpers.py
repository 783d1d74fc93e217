"""Processes a test started, read from /proc: their children, whether they still
run, what the ones left running are doing, and killing the leftovers."""
import os
import pathlib
import signal
import time


def state(pid):
    """The /proc state letter of `pid`, or None when it no longer exists."""
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
    except OSError:
        return None


def children(pid):
    """The pids whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry))
    return out


def describe(pid):
    """What a process left running is doing: its command line, and each thread's
    name, state and the kernel function it waits in."""
    def read(path):
        try:
            return pathlib.Path(path).read_text(errors="replace").strip()
        except OSError:
            return "?"
    threads = [f"{read(f'{t}/comm')} {_state_of(read(f'{t}/stat'))} {read(f'{t}/wchan')}"
               for t in sorted(pathlib.Path(f"/proc/{pid}/task").glob("*"))]
    return (f"pid {pid} ({state(pid)}): {read(f'/proc/{pid}/cmdline').replace(chr(0), ' ')}; "
            f"threads: {threads}")


def _state_of(stat: str) -> str:
    return stat.rpartition(")")[2].split()[0] if ")" in stat else "?"


def wait_gone(pids, timeout=10.0):
    """Descriptions (`describe`) of the pids still running (not exited) after `timeout`;
    zombies count as gone only when they are not ours to reap (their parent, the
    launcher, is dead)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if state(p) not in (None, "Z")]
        if not alive or time.monotonic() > deadline:
            return [describe(p) for p in alive]
        time.sleep(0.1)


def kill_leftovers(pids):
    for pid in pids:
        if state(pid) not in (None, "Z"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
