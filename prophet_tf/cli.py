"""The `prophet-tf` command line: one entry point, one subcommand per tool.

    prophet-tf ps [...]        run a parameter-server task
    prophet-tf launch [...]    run a whole cluster on this machine
    prophet-tf doctor          check this machine and the cluster of TF_CONFIG
    prophet-tf plot [...]      draw timelines or a bench result as an image
    prophet-tf bench [...]     compare schedulers on an emulated cluster (netns + tc)
    prophet-tf simulate [...]  discrete-event simulation of the schedulers
    prophet-tf report [...]    render (or check) the README's tables from their JSON
    prophet-tf --version       prophet_tf's version, and the TensorFlow it was built against
"""
from __future__ import annotations

import os
import sys

_COMMANDS = {
    "ps": ("prophet_tf.ps.server", "run a parameter-server task (from TF_CONFIG or flags)"),
    "launch": ("prophet_tf.tools.launch", "start PS tasks and worker processes on localhost"),
    "doctor": ("prophet_tf.tools.doctor", "check versions, the op library and the PS tasks of TF_CONFIG"),
    "plot": ("prophet_tf.tools.plot", "draw timelines (Gantt chart per worker) or a bench result"),
    "bench": ("prophet_tf.bench.bench_cli", "compare schedulers on an emulated bandwidth-limited cluster"),
    "simulate": ("prophet_tf.bench.simulate_cli", "simulate the schedulers on a profiled model at any scale"),
    "report": ("prophet_tf.bench.report", "render or check the README's result tables from their JSON"),
}


def _usage() -> str:
    lines = ["usage: prophet-tf COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "Run 'prophet-tf COMMAND --help' for a command's options;",
              "'prophet-tf --version' prints the version."]
    return "\n".join(lines)


def version_text() -> str:
    """``prophet_tf X.Y.Z`` and, when the op library was built, the TensorFlow
    it was built against (read from _build_info.json: TensorFlow is not imported)."""
    from prophet_tf import __version__
    from prophet_tf import _build_info
    built = _build_info.read().get("tensorflow_version")
    suffix = f" (op library built against TensorFlow {built})" if built else \
        " (op library not built)"
    return f"prophet_tf {__version__}{suffix}"


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version_text())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"prophet-tf: unknown command {name!r}; valid commands: "
              f"{', '.join(_COMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    import importlib
    from prophet_tf._build_info import INSTALL_HINT, tensorflow_installed
    # doctor reports a missing TensorFlow itself; the others need it to run
    # (--help and a few options do not, but an install hint beats a deep traceback).
    if name != "doctor" and not ({"-h", "--help"} & set(rest)) and not tensorflow_installed():
        print(f"prophet-tf {name}: needs TensorFlow, and none is installed. {INSTALL_HINT}",
              file=sys.stderr)
        return 1
    from prophet_tf import extras
    module = importlib.import_module(_COMMANDS[name][0])
    try:
        return module.main(rest) or 0
    except extras.MissingExtra as e:  # an optional dependency: say which extra brings it
        print(f"prophet-tf {name}: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """Runs one command. Output piped into a reader that stops early
    (`prophet-tf -h | head`) ends the command quietly, as other CLI tools do."""
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader is gone: send what is left of stdout to /dev/null so the
        # interpreter's own flush at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a killed writer


if __name__ == "__main__":
    sys.exit(main())
