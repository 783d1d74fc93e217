"""`prophet-tf launch --hosts`: a cluster's tasks started on several hosts over ssh.

    prophet-tf launch --hosts a:2,b:2 [--ps 1] [--ssh-port P] [--ssh-identity-file F]
        [--ssh-option KEY=VALUE ...] [--env NAME[=VALUE] ...] -- python train.py

- :func:`parse_hosts`: the host list, ``HOST[:WORKERS],...`` (horovodrun's
  ``-H``): WORKERS worker tasks on HOST (1 when left out). Every host also
  runs ``--ps`` PS tasks (default 1): the colocated layout.
- :class:`SshOptions`: how the system ``ssh`` is called (``BatchMode=yes``:
  it never prompts).
- :class:`RemoteTask`: one task's ssh session. The task's environment (its
  TF_CONFIG and the cluster's token among it) goes as the session's first
  line of standard input, never on a command line; closing that input stops
  the task on its host (``_remote_task``).
- :class:`SshHosts`: where ``launch``'s cluster puts its tasks: host by host
  in the order given, workers 0.. and PS tasks 0.. numbered host by host;
  every name in TF_CONFIG is the host as given, PS ports are picked by the
  PS tasks (port 0) and reported back over the session.

On each host the task runs in the launcher's working directory under the
launcher's Python (``sys.executable``): both paths must exist on every host.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Callable, Mapping, Sequence

from prophet_tf import environment
from prophet_tf.tools import launched_tasks
from prophet_tf.tools._remote_task import MARKER

__all__ = ["FORWARDED_PREFIXES", "Host", "RemoteTask", "SshHosts", "SshOptions",
           "parse_env_items", "parse_hosts"]

logger = logging.getLogger(__name__)

#: Variables of the launcher's environment that every remote task gets (with
#: --env's): prophet_tf's, TensorFlow's and Keras' settings; not TF_VAR_*
#: (Terraform's), TF_CONFIG (each task's own) or PROPHET_TF_TOKEN_FILE (the
#: token itself is sent).
FORWARDED_PREFIXES = ("PROPHET_TF_", "TF_", "KERAS_")
_NOT_FORWARDED = ("TF_CONFIG", environment.TOKEN_FILE, environment.STATUS_FILE)
#: Worker j of a host is named HOST:(WORKER_BASE_PORT + j) in TF_CONFIG. Workers do
#: not listen: the name only has to be a valid address, and these ports lie below
#: the ephemeral range that the PS tasks' ports (port 0) come from.
WORKER_BASE_PORT = 2223
#: How long a task's host may take to stop it after its input closed, beyond the
#: launcher's grace period, before the launcher ends the ssh session itself.
REMOTE_STOP_S = 10.0
_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?$")
# HOST[:WORKERS], HOST an IPv6 address in brackets or anything without colons.
_ENTRY = re.compile(r"^(?P<name>\[[^\]]*\]|[^:\[\]]*)(?::(?P<workers>.*))?$")
_IPV6 = re.compile(r"^\[[0-9A-Fa-f:.]+(%[\w.-]+)?\]$")
_SSH_OPTION = re.compile(r"^[A-Za-z][A-Za-z0-9]*=\S.*$")


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of ``--hosts``: its name as given (what TF_CONFIG names, an IPv6
    address in brackets) and its number of workers."""

    name: str
    workers: int

    @property
    def destination(self) -> str:
        """What ssh dials: the name, an IPv6 address without brackets."""
        return self.name[1:-1] if self.name.startswith("[") else self.name


def parse_hosts(text: str) -> list[Host]:
    """Reads ``--hosts``: ``HOST[:WORKERS]`` entries separated by commas.

    Raises:
      ValueError: an empty list or entry, a malformed host name (``user@host``
        included: give ``--ssh-option User=NAME``), WORKERS not an integer >= 1,
        a host named twice, or a loopback name among several hosts (the others
        would dial themselves); the message ends with what was received.
    """
    received = f"Received: --hosts {text!r}"
    if not text or not text.strip():
        raise ValueError(f"--hosts needs at least one host, HOST[:WORKERS],... {received}")
    hosts = []
    for number, entry in enumerate(text.split(","), 1):
        entry = entry.strip()
        if not entry:
            raise ValueError(f"--hosts entry {number} is empty (HOST[:WORKERS],...). {received}")
        if entry.count(":") > 1 and not entry.startswith("["):
            raise ValueError(f"--hosts: write an IPv6 address in brackets, [ADDRESS]:WORKERS. "
                             f"Received: {entry!r} in --hosts {text!r}")
        match = _ENTRY.match(entry)
        name, workers = (match["name"], match["workers"]) if match else (entry, None)
        if "@" in name:
            raise ValueError(f"--hosts takes host names, not ssh targets: give the user with "
                             f"--ssh-option User=NAME. Received: {entry!r} in --hosts {text!r}")
        if not match or not (_HOST_NAME.match(name) or _IPV6.match(name)):
            raise ValueError(f"--hosts entry {number}: {name!r} is not a host name or address. "
                             f"{received}")
        if workers is not None and (not re.fullmatch(r"[0-9]+", workers) or int(workers) < 1):
            raise ValueError(f"--hosts: the number of workers after the colon must be an "
                             f"integer >= 1 (a bare HOST runs 1). Received: {entry!r} in "
                             f"--hosts {text!r}")
        hosts.append(Host(name, 1 if workers is None else int(workers)))
    names = [h.name.lower() for h in hosts]
    twice = sorted({h.name for h in hosts if names.count(h.name.lower()) > 1})
    if twice:
        raise ValueError(f"--hosts names a host twice ({', '.join(twice)}); give each host "
                         f"once with its number of workers, HOST:WORKERS. {received}")
    from prophet_tf.ps.security import is_loopback

    loopback = [h.name for h in hosts if is_loopback(h.name)]
    if loopback and len(hosts) > 1:
        raise ValueError(f"--hosts mixes a loopback name ({', '.join(loopback)}) with other "
                         "hosts, which would dial themselves at that name; name every host by "
                         f"an address the others reach. {received}")
    return hosts


def parse_env_items(items: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """``--env NAME=VALUE`` (set) and ``--env NAME`` (this environment's value), as a dict.

    Raises:
      ValueError: a malformed NAME, or a NAME alone that ``env`` does not set.
    """
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise ValueError(f"--env takes NAME=VALUE or NAME. Received: --env {item!r}")
        if not sep and name not in env:
            raise ValueError(f"--env {name} forwards this environment's {name}, which is not "
                             f"set here; give --env {name}=VALUE. Received: --env {item!r}")
        out[name] = value if sep else env[name]
    return out


@dataclasses.dataclass(frozen=True)
class SshOptions:
    """How ``ssh`` reaches the hosts.

    Args:
      port: ``-p`` (None: ssh's own default or configuration).
      identity_file: ``-i`` (a private key on this machine).
      options: ``KEY=VALUE`` strings, each passed as ``-o KEY=VALUE``. For each
        key ssh keeps the first value it gets, so these come before the
        launcher's defaults (``ServerAliveInterval=15``,
        ``ServerAliveCountMax=4``) but after ``BatchMode=yes``.
    """

    port: int | None = None
    identity_file: str | None = None
    options: tuple[str, ...] = ()

    def check(self) -> None:
        """Raises ValueError naming what was received for a bad option, or no ssh."""
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"--ssh-port must be in [1, 65535]. Received: --ssh-port {self.port}")
        if self.identity_file is not None and not os.path.isfile(self.identity_file):
            raise ValueError("--ssh-identity-file must be an existing file (a private key). "
                             f"Received: --ssh-identity-file {self.identity_file!r}")
        for option in self.options:
            if not _SSH_OPTION.match(option):
                raise ValueError("--ssh-option takes KEY=VALUE (ssh's -o, e.g. User=ubuntu). "
                                 f"Received: --ssh-option {option!r}")
        if shutil.which("ssh") is None:
            raise ValueError("--hosts starts every task with the ssh client, which is not on "
                             f"PATH (Debian: apt-get install openssh-client). Received: "
                             f"PATH={os.environ.get('PATH', '')!r}")

    def argv(self, destination: str, remote_command: str) -> list[str]:
        """The local command that runs ``remote_command`` on ``destination``."""
        argv = ["ssh", "-T", "-o", "BatchMode=yes"]
        for option in self.options:
            argv += ["-o", option]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file is not None:
            argv += ["-i", self.identity_file]
        return [*argv, "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4", "--",
                destination, remote_command]


class RemoteTask(launched_tasks.Task):
    """One task on another host: its ssh session, relayed like a local task.

    The task's environment goes as the first line of the session's standard
    input. Lines of the remote side's markers (its PS port, a worker's status)
    are taken out of the output. :meth:`terminate` closes the input, so the
    task's host stops it; :meth:`stop` ends the ssh session itself if that
    takes longer than the grace period plus :data:`REMOTE_STOP_S`.

    Args:
      name: the task's name (``worker 0@host``), which prefixes its lines.
      argv: the ssh command.
      task_env: what the task gets on its host, besides that host's own
        environment.
      out: where its prefixed lines go.
    """

    def __init__(self, name: str, argv: list[str], task_env: dict[str, str], out=None):
        self.port: int | None = None
        self._status: dict | None = None
        # The ssh client's own environment: this one, without the token.
        local = {k: v for k, v in os.environ.items()
                 if k not in (environment.TOKEN, environment.TOKEN_FILE)}
        super().__init__(name, argv, local, out, stdin=json.dumps(task_env).encode() + b"\n",
                         drop_banners=launched_tasks.hides_banners(task_env))

    def take(self, line: bytes) -> bool:
        if not line.startswith(MARKER):
            return False
        try:
            fields = json.loads(line[len(MARKER):])
        except ValueError:
            return False
        if not isinstance(fields, dict):
            return False
        if isinstance(fields.get("port"), int):
            self.port = fields["port"]
        if isinstance(fields.get("status"), dict):
            self._status = fields["status"]
        return True

    def status(self) -> dict | None:
        """What the task last reported of its status file (workers only)."""
        return self._status

    def terminate(self) -> None:
        """Closes the session's input: the task's host stops it (SIGTERM, then SIGKILL)."""
        self._terminated = True
        self.close_stdin()

    def stop(self, grace_s: float = 5.0) -> None:
        """Closes the input, waits for the session to end, then ends ssh; always reaps."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(grace_s + REMOTE_STOP_S)
            except subprocess.TimeoutExpired:
                logger.warning("%s: its host did not stop it within %.0f s; ending its ssh "
                               "session", self.name, grace_s + REMOTE_STOP_S)
                self.process.terminate()
                try:
                    self.process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        self._relay.join(timeout=2.0)


def wait_for_port(task: RemoteTask, timeout_s: float, alive: Callable[[], None]) -> int:
    """The port ``task`` (a PS) reports once it listens.

    Raises:
      TimeoutError: none within ``timeout_s``; whatever ``alive`` raises.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive()
        if task.port is not None:
            return task.port
        time.sleep(0.05)
    raise TimeoutError(f"{task.name} did not report its port within {timeout_s:.0f} s")


class SshHosts:
    """Where ``launch`` puts a cluster's tasks with ``--hosts``: over ssh, host by host.

    Args:
      hosts: from :func:`parse_hosts`.
      ps_per_host: PS tasks on every host.
      ssh: how to call ssh (checked here).
      base_env: the launcher's task environment (the token in it, inline or as
        a file); every remote task gets its :data:`FORWARDED_PREFIXES`
        variables and those of ``forward``.
      forward: the names of ``--env``.
      cwd: the working directory on every host (default: this process's).

    Raises:
      ValueError: bad ssh options, or no token in ``base_env``.
    """

    def __init__(self, hosts: Sequence[Host], ps_per_host: int, ssh: SshOptions,
                 base_env: Mapping[str, str], forward: Sequence[str] = (),
                 cwd: str | None = None):
        from prophet_tf.ps import security as security_lib

        ssh.check()
        token = security_lib.load_token(base_env)
        if token is None:
            raise ValueError(f"remote tasks need the cluster's token. Received: neither "
                             f"{environment.TOKEN} nor {environment.TOKEN_FILE} set")
        self.hosts, self.ps_per_host, self.ssh = list(hosts), ps_per_host, ssh
        self.cwd = os.getcwd() if cwd is None else cwd
        self.num_workers = sum(h.workers for h in self.hosts)
        self.num_ps = ps_per_host * len(self.hosts)
        self._ps_hosts = [h for h in self.hosts for _ in range(ps_per_host)]
        self._worker_hosts = [(h, j) for h in self.hosts for j in range(h.workers)]
        self._env = {k: v for k, v in base_env.items()
                     if (k.startswith(FORWARDED_PREFIXES) or k in forward)
                     and not k.startswith("TF_VAR_") and k not in _NOT_FORWARDED}
        self._env[environment.TOKEN] = token.value  # A token file may exist here only.

    def ps_name(self, i: int) -> str:
        return f"ps {i}@{self._ps_hosts[i].name}"

    def worker_name(self, i: int) -> str:
        return f"worker {i}@{self._worker_hosts[i][0].name}"

    def _start(self, name: str, host: Host, wrapper: list[str], command: list[str],
               extra: Mapping[str, str], out) -> RemoteTask:
        remote = (f"cd {shlex.quote(self.cwd)} && exec " + shlex.join(
            [sys.executable, "-m", "prophet_tf.tools._remote_task", *wrapper, "--", *command]))
        argv = self.ssh.argv(host.destination, remote)
        logger.debug("starting %s: %s", name, shlex.join(argv))
        return RemoteTask(name, argv, {**self._env, **extra}, out)

    def start_ps(self, i: int, ps_args: list[str], extra: Mapping[str, str], out,
                 tmp: str) -> RemoteTask:
        """PS task i on its host, bound to every interface on a port it picks."""
        argv = [sys.executable, "-m", "prophet_tf", "ps", "--host", "[::]", "--port", "0",
                *ps_args]
        return self._start(self.ps_name(i), self._ps_hosts[i], ["--port-flag=--port-file"],
                           argv, extra, out)

    def ps_address(self, task: RemoteTask, i: int, timeout_s: float,
                   alive: Callable[[], None]) -> str:
        return f"{self._ps_hosts[i].name}:{wait_for_port(task, timeout_s, alive)}"

    def worker_addresses(self) -> list[str]:
        return [f"{h.name}:{WORKER_BASE_PORT + j}" for h, j in self._worker_hosts]

    def start_worker(self, i: int, command: list[str], extra: Mapping[str, str], out,
                     tmp: str) -> RemoteTask:
        """Worker i on its host, reporting its status file's changes."""
        return self._start(self.worker_name(i), self._worker_hosts[i][0], ["--status"],
                           list(command), extra, out)
