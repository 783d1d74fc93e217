"""Start a prophet_tf job on several hosts over ssh (EC2 or any Linux hosts).

    python examples/ec2/launch_ec2.py hosts.txt --cwd /home/ubuntu/prophet_tf \\
        -- python examples/train_digits.py

HOSTS file: one host per line, ``SSH_TARGET ROLE [ADDRESS[:PORT]]``; ``#``
starts a comment. ROLE is ``ps`` or ``worker``; tasks of a role are numbered
in file order. ADDRESS is what the other hosts dial (on EC2, the private IP);
it defaults to SSH_TARGET without ``user@``, and PORT to ``--port`` (2222).

For every host, this script builds its TF_CONFIG and runs, over
``ssh SSH_TARGET``, ``cd CWD && env TF_CONFIG=... PS-or-worker command``: PS
hosts run ``PYTHON -m prophet_tf ps``, worker hosts the command after
``--``. Every output line is printed prefixed with the host and task. When
a task fails (non-zero exit), all others are stopped and this script exits
with that code; once every worker succeeded, the PS tasks are stopped and it
exits 0.

The token (``PROPHET_TF_TOKEN``, or ``--token-file``, else a new random one)
is written to each ssh's standard input, never on a command line, where
other users of either host could read it in the process list. The remote
side reads it, then watches its standard input: when this script stops a
task (or dies), ssh closes and the remote command gets SIGTERM.

``--workers-per-host N`` (one worker per GPU): every ``worker`` line stands
for N workers on that host, on PORT, PORT+1, ..., PORT+N-1, numbered line by
line; the j-th gets ``CUDA_VISIBLE_DEVICES=j`` (or the j-th entry of an
``--env CUDA_VISIBLE_DEVICES=LIST``) and every PS task
``CUDA_VISIBLE_DEVICES=""``, so that it takes no GPU memory.

``--dry-run`` prints each host's TF_CONFIG and command and runs nothing.
``--local`` runs the same commands on this machine through ``sh`` instead of
ssh, with every address replaced by 127.0.0.1 and a free port: a rehearsal
of the whole job on one host.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

ROLES = ("ps", "worker")
DEFAULT_PORT = 2222
TOKEN_ENV = "PROPHET_TF_TOKEN"
CUDA_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# What CUDA accepts in CUDA_VISIBLE_DEVICES: an index, or a GPU or MIG UUID (or its prefix).
_CUDA_DEVICE = re.compile(r"^(\d+|GPU-[0-9a-fA-F-]+|MIG-[0-9a-zA-Z/-]+)$")


@dataclasses.dataclass
class Host:
    """One line of the hosts file: where to ssh, which task, the address others dial."""

    target: str
    role: str
    address: str
    index: int = 0
    device: str | None = None  # its CUDA_VISIBLE_DEVICES; None: left as the host has it

    @property
    def name(self) -> str:
        return f"{self.target} {self.role} {self.index}"


def worker_devices(workers_per_host: int, visible: str | None = None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES of a host's workers 0..N-1, one GPU each: the
    first N entries of `visible` (an ``--env CUDA_VISIBLE_DEVICES``), else 0..N-1.

    The rules of ``prophet_tf.tools.gpus.gpu_devices``, kept here because this
    script needs only the standard library (no TensorFlow where it runs).

    Raises:
      ValueError: N < 1; `visible` empty, malformed, naming a device twice or fewer than N.
    """
    if isinstance(workers_per_host, bool) or not isinstance(workers_per_host, int) or \
            workers_per_host < 1:
        raise ValueError("--workers-per-host must be an integer >= 1. "
                         f"Received: --workers-per-host {workers_per_host!r}")
    if visible is None:
        return [str(j) for j in range(workers_per_host)]
    received = f"Received: --env {CUDA_DEVICES_ENV}={visible}, --workers-per-host " \
               f"{workers_per_host}"
    devices = [d.strip() for d in visible.split(",")]
    if not visible.strip():
        raise ValueError(f"an empty {CUDA_DEVICES_ENV} hides every GPU. {received}")
    for device in devices:
        if not _CUDA_DEVICE.match(device):
            raise ValueError(f"{CUDA_DEVICES_ENV} must be a comma-separated list of GPU indices "
                             f"or UUIDs, e.g. 0,1,3; {device!r} is neither. {received}")
    if len(set(devices)) < len(devices):
        raise ValueError(f"{CUDA_DEVICES_ENV} names a device twice; one worker per GPU needs "
                         f"distinct devices. {received}")
    if len(devices) < workers_per_host:
        raise ValueError(f"{workers_per_host} workers per host need {workers_per_host} devices "
                         f"but {CUDA_DEVICES_ENV} names {len(devices)}. {received}")
    return devices[:workers_per_host]


def parse_hosts(text: str, default_port: int = DEFAULT_PORT,
                devices: list[str] | None = None) -> list[Host]:
    """Reads a hosts file's content.

    Args:
      text: the file's content.
      default_port: the port of an address given without one.
      devices: one worker per GPU (see `worker_devices`): every worker line
        stands for len(devices) workers on ports PORT.. PORT+len-1, the j-th
        with CUDA_VISIBLE_DEVICES=devices[j]; PS tasks get "". None: one
        worker per line, CUDA_VISIBLE_DEVICES left alone.

    Raises:
      ValueError: a malformed line (with its number), an unknown role, a
        duplicate address, a port past 65535, or no ps / no worker.
    """
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) not in (2, 3):
            raise ValueError(f"hosts file line {number}: expected SSH_TARGET ROLE [ADDRESS[:PORT]]."
                             f" Received: {raw!r}")
        target, role = fields[0], fields[1].lower()
        if role not in ROLES:
            raise ValueError(f"hosts file line {number}: the role must be one of {ROLES}. "
                             f"Received: {fields[1]!r}")
        address = fields[2] if len(fields) == 3 else target.rpartition("@")[2]
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():  # No port given (an IPv6 address needs [..]:port).
            address = f"{address}:{default_port}"
        elif not 0 < int(port) < 65536:
            raise ValueError(f"hosts file line {number}: bad port. Received: {address!r}")
        if devices is None:
            hosts.append(Host(target, role, address))
        elif role == "ps":
            hosts.append(Host(target, role, address, device=""))  # A PS needs no GPU memory.
        else:
            host, _, port = address.rpartition(":")
            last = int(port) + len(devices) - 1
            if last > 65535:
                raise ValueError(f"hosts file line {number}: {len(devices)} workers per host "
                                 f"need ports {port}..{last}, past 65535. Received: {address!r}")
            hosts += [Host(target, role, f"{host}:{int(port) + j}", device=device)
                      for j, device in enumerate(devices)]
    for role in ROLES:
        tasks = [h for h in hosts if h.role == role]
        if not tasks:
            raise ValueError(f"the hosts file names no {role} host. Received: "
                             f"{len(hosts)} host(s): {[h.role for h in hosts]}")
        for i, h in enumerate(tasks):
            h.index = i
    addresses = [h.address for h in hosts]
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise ValueError(f"two tasks cannot share an address. Received: {duplicates}")
    return hosts


def tf_configs(hosts: list[Host]) -> dict[str, dict]:
    """Each host's TF_CONFIG, by host name."""
    cluster = {role: [h.address for h in hosts if h.role == role] for role in ROLES}
    return {h.name: {"cluster": cluster, "task": {"type": h.role, "index": h.index}}
            for h in hosts}


def localize(hosts: list[Host]) -> list[Host]:
    """The same cluster on 127.0.0.1, every task on a free port."""
    return [dataclasses.replace(h, target="localhost", address=f"127.0.0.1:{_free_port()}")
            for h in hosts]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task_env(host: Host, env: dict[str, str]) -> dict[str, str]:
    """The extra environment of `host`'s task: `env`, then its own CUDA_VISIBLE_DEVICES."""
    return env if host.device is None else {**env, CUDA_DEVICES_ENV: host.device}


def remote_script(command: list[str], tf_config: dict, cwd: str | None,
                  env: dict[str, str]) -> str:
    """The POSIX sh script each host runs: read the token from stdin, start the
    task, and stop it (SIGTERM) when stdin closes, i.e. when its ssh goes away."""
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in
                           {"TF_CONFIG": json.dumps(tf_config, separators=(",", ":")),
                            **env}.items())
    cd = f"cd {shlex.quote(cwd)} || exit 127\n" if cwd else ""
    return (
        f"IFS= read -r {TOKEN_ENV} || exit 126\n"
        f"export {TOKEN_ENV}\n"
        f"{cd}"
        "exec 3<&0\n"
        f"env {assignments} {shlex.join(command)} </dev/null 3<&- &\n"
        "child=$!\n"
        # Stdin reaches EOF when the launcher closes it or its ssh dies. The
        # watcher holds none of the session's output, so ssh ends with the task.
        "( cat <&3; kill -TERM $child ) </dev/null >/dev/null 2>&1 &\n"
        "watcher=$!\n"
        "exec 3<&-\n"
        "wait $child\n"
        "code=$?\n"
        "kill $watcher 2>/dev/null\n"
        "exit $code\n")


def host_argv(host: Host, script: str, local: bool, ssh: list[str]) -> list[str]:
    """The local command that runs `script` on `host`."""
    if local:
        return ["sh", "-c", script]
    return [*ssh, host.target, script]


class _Task:
    def __init__(self, host: Host, argv: list[str], token: str, out):
        self.host = host
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)
        self.process.stdin.write(f"{token}\n".encode())
        self.process.stdin.flush()
        self._relay = threading.Thread(target=self._pump, args=(out,), daemon=True)
        self._relay.start()

    def _pump(self, out):
        prefix = f"[{self.host.name}] "
        for line in iter(self.process.stdout.readline, b""):
            out.write(prefix + line.decode(errors="replace"))
            out.flush()

    def close_stdin(self):
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def stop(self, grace_s: float):
        """Closes stdin (the remote side stops its command), then terminates ssh."""
        self.close_stdin()
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._relay.join(timeout=2)


def run(hosts: list[Host], command: list[str], *, token: str, cwd: str | None,
        python: str, env: dict[str, str], local: bool, ssh: list[str], grace_s: float = 15.0,
        out=None) -> int:
    """Starts every task, relays their output, and stops all at the first failure."""
    out = out or sys.stdout
    configs = tf_configs(hosts)
    stopping = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stopping.set())
                for s in (signal.SIGTERM, signal.SIGINT)}
    tasks: list[_Task] = []
    try:
        for h in sorted(hosts, key=lambda h: h.role != "ps"):  # PS tasks first.
            task_command = [python, "-m", "prophet_tf", "ps"] if h.role == "ps" else command
            script = remote_script(task_command, configs[h.name], cwd, task_env(h, env))
            tasks.append(_Task(h, host_argv(h, script, local, ssh), token, out))
        workers = [t for t in tasks if t.host.role == "worker"]
        while not stopping.is_set():
            for t in tasks:
                code = t.process.poll()
                if code not in (None, 0) or (code == 0 and t.host.role == "ps"):
                    print(f"launch_ec2: {t.host.name} exited with code {code}; stopping the "
                          "others", file=sys.stderr, flush=True)
                    return code if code > 0 else 128 - code if code < 0 else 1
            if all(t.process.poll() == 0 for t in workers):
                print("launch_ec2: every worker finished; stopping the PS tasks",
                      file=sys.stderr, flush=True)
                return 0
            time.sleep(0.2)
        print("launch_ec2: interrupted; stopping every task", file=sys.stderr, flush=True)
        return 130
    finally:
        for t in tasks:  # Every remote side learns at once; then wait for each.
            t.close_stdin()
        for t in tasks:
            t.stop(grace_s)
        for s, handler in previous.items():
            signal.signal(s, handler)


def dry_run(hosts: list[Host], command: list[str], *, cwd: str | None, python: str,
            env: dict[str, str], local: bool, ssh: list[str], out=None) -> None:
    """Prints what `run` would start, with the token left out."""
    out = out or sys.stdout
    configs = tf_configs(hosts)
    for h in sorted(hosts, key=lambda h: h.role != "ps"):
        task_command = [python, "-m", "prophet_tf", "ps"] if h.role == "ps" else command
        script = remote_script(task_command, configs[h.name], cwd, task_env(h, env))
        device = "" if h.device is None else f"; {CUDA_DEVICES_ENV}={shlex.quote(h.device)}"
        print(f"# {h.name}: dials {h.address}{device}", file=out)
        print(f"# TF_CONFIG={json.dumps(configs[h.name])}", file=out)
        print(f"# stdin: the token ({TOKEN_ENV}), one line", file=out)
        print(shlex.join(host_argv(h, script, local, ssh)), file=out)
        print(file=out)


def _load_token(token_file: str | None) -> str:
    if token_file:
        try:
            token = open(token_file).read().strip()
        except OSError as e:
            raise ValueError(f"cannot read the token file: {e.strerror}. "
                             f"Received: --token-file {token_file}") from None
        if not token or "\n" in token:
            raise ValueError(f"the token file must hold one non-empty line. "
                             f"Received: --token-file {token_file}")
        return token
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="launch_ec2.py HOSTS [--workers-per-host N] [options] -- WORKER_COMMAND [ARGS]",
        epilog="See examples/ec2/README.md for the hosts file, security group and token.")
    parser.add_argument("hosts", help="hosts file: SSH_TARGET ROLE [ADDRESS[:PORT]] per line")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port of an address given without one (default {DEFAULT_PORT})")
    parser.add_argument("--workers-per-host", type=int, default=None, metavar="N",
                        help="one worker per GPU: each worker line starts N workers on PORT.."
                             "PORT+N-1, the j-th with CUDA_VISIBLE_DEVICES=j (or the j-th entry "
                             "of --env CUDA_VISIBLE_DEVICES=LIST); PS tasks get "
                             "CUDA_VISIBLE_DEVICES=\"\"")
    parser.add_argument("--cwd", default=None,
                        help="directory to cd into on each host (the checkout)")
    parser.add_argument("--python", default=None,
                        help="Python that runs `-m prophet_tf ps` on the PS hosts (default "
                             "python3; with --local this interpreter)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for every task, e.g. PROPHET_TF_SCHEDULER="
                             "prophet (repeatable)")
    parser.add_argument("--token-file", default=None,
                        help=f"file holding the token (default ${TOKEN_ENV}, else a new one)")
    parser.add_argument("--ssh", default="ssh -o BatchMode=yes -o ServerAliveInterval=15",
                        help="ssh command (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=15.0,
                        help="seconds a task gets to stop before its ssh is terminated")
    parser.add_argument("--dry-run", action="store_true", help="print the commands; run none")
    parser.add_argument("--local", action="store_true",
                        help="run every task on this machine (127.0.0.1, free ports), no ssh")
    args = parser.parse_args(argv)
    try:
        if not command:
            raise ValueError("no worker command given; put it after `--`. Received: []")
        env = {}
        for item in args.env:
            name, sep, value = item.partition("=")
            if not sep or not name.isidentifier():
                raise ValueError(f"--env takes NAME=VALUE. Received: --env {item}")
            env[name] = value
        devices = None
        if args.workers_per_host is not None:
            # The list, if given, is split among each host's workers: no task gets all of it.
            devices = worker_devices(args.workers_per_host, env.pop(CUDA_DEVICES_ENV, None))
        with open(args.hosts) as f:
            hosts = parse_hosts(f.read(), args.port, devices)
        if args.local:
            hosts = localize(hosts)
        python = args.python or (sys.executable if args.local else "python3")
        ssh = shlex.split(args.ssh)
        if args.dry_run:
            dry_run(hosts, command, cwd=args.cwd, python=python, env=env, local=args.local,
                    ssh=ssh)
            return 0
        return run(hosts, command, token=_load_token(args.token_file), cwd=args.cwd,
                   python=python, env=env, local=args.local, ssh=ssh, grace_s=args.grace)
    except (OSError, ValueError) as e:
        print(f"launch_ec2: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
