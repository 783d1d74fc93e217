"""`python -m prophet_tf.tools._die_with_parent PARENT_PID CMD...`: exec CMD, which dies with PARENT_PID.

`prophet-tf launch` starts every task through this instead of a
``preexec_fn``: a ``preexec_fn`` makes Python fork() (not vfork), which runs
gRPC's fork handlers in the child. The launcher has live gRPC threads (its
health checks), and in the child their poller found its epoll descriptor
closed by ``close_fds`` and aborted the task before it started (SIGABRT,
"epoll_wait error: Bad file descriptor"). Without a ``preexec_fn`` Python
spawns with vfork, which runs no fork handlers; the death signal is set here,
in a fresh process with no threads, before the task's own program runs.
"""
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with(parent_pid: int) -> None:
    """This process gets SIGTERM when its parent, ``parent_pid``, ends (and
    ends now if it already has). Also a process pool's initializer."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent_pid:  # The parent died before prctl took effect.
        os._exit(128 + signal.SIGTERM)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m prophet_tf.tools._die_with_parent PARENT_PID CMD [ARGS...]. "
                 f"Received: {argv!r}")
    parent_pid, command = int(argv[0]), argv[1:]
    die_with(parent_pid)
    try:
        os.execvp(command[0], command)
    except OSError as e:  # The shell's codes: 127 not found, 126 not executable.
        print(f"cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


if __name__ == "__main__":
    main(sys.argv[1:])
