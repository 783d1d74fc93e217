"""The `prophet-tf` command line: one entry point, one subcommand per tool.

    prophet-tf ps [...]        run a parameter-server task
    prophet-tf launch [...]    run a whole cluster on this machine
    prophet-tf doctor          check this machine and the cluster of TF_CONFIG
    prophet-tf plot [...]      draw timelines or a bench result as an image
    prophet-tf bench [...]     compare schedulers on an emulated cluster (netns + tc)
    prophet-tf simulate [...]  discrete-event simulation of the schedulers
    prophet-tf report [...]    render (or check) the README's tables from their JSON
"""
from __future__ import annotations

import sys

_COMMANDS = {
    "ps": ("prophet_tf.ps.server", "run a parameter-server task (from TF_CONFIG or flags)"),
    "launch": ("prophet_tf.tools.launch", "start PS tasks and worker processes on localhost"),
    "doctor": ("prophet_tf.tools.doctor", "check versions, the op library and the PS tasks of TF_CONFIG"),
    "plot": ("prophet_tf.tools.plot", "draw timelines (Gantt chart per worker) or a bench result"),
    "bench": ("prophet_tf.bench.runner", "compare schedulers on an emulated bandwidth-limited cluster"),
    "simulate": ("prophet_tf.bench.simulate_cli", "simulate the schedulers on a profiled model at any scale"),
    "report": ("prophet_tf.bench.report", "render or check the README's result tables from their JSON"),
}


def _usage() -> str:
    lines = ["usage: prophet-tf COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "Run 'prophet-tf COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"prophet-tf: unknown command {name!r}; valid commands: "
              f"{', '.join(_COMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    import importlib
    module = importlib.import_module(_COMMANDS[name][0])
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
