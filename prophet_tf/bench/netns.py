"""An emulated cluster on one machine: one network namespace per host, shaped links.

Topology (everything lives in namespaces of this run; the root namespace gets
no interface, address or route)::

    <id>-h0 (10.213.7.1) eth0 ══veth══ h0 ┐
    <id>-h1 (10.213.7.2) eth0 ══veth══ h1 ├─ br0 in <id>-br
    ...                                    ┘

Each host's link is shaped on both ends of its veth pair, so both directions
are limited: the host end (``eth0``) shapes what the host sends, the bridge
end (``hI``) what it receives. The bridge end is a token bucket (``tbf``)
of the given rate with one queue, as a switch port. The host end, with
``host_queue="fair"`` (the default), sends its connections' packets in turn:
a real host's uplink does (``fq_codel``, the queue discipline systemd-based
Linux sets by default, serves flows round robin), while TCP through one
shaped queue keeps some connections starved for whole seconds (their
congestion windows stay small, and the queue, throttled by TCP Small Queues,
never drops a packet that would even them out: ``benchmarks/flow_share.py``).
This kernel has neither ``fq_codel`` nor ``sfq``, so the fair queue is built
from what it has: an HTB class of the link's rate over :data:`FAIR_BUCKETS`
leaf classes that share it equally, and a classic BPF classifier that hashes
each TCP packet's ports to a leaf (two connections can share a leaf, as in
``sfq``). ``host_queue="fifo"`` shapes the host end with one ``tbf`` too.
An optional one-way latency is a ``netem`` delay on the host end (so two
hosts see a round trip of 2·latency). Traffic between hosts crosses
two shaped links; with W workers and one PS, the PS's link is the bottleneck
when all push at once, as on a real cluster with one NIC per host.

Addresses are in :data:`SUBNET` (10.213.7.0/24), which exists only inside
these namespaces; nothing is sent anywhere else.

Names: every namespace of a run starts with ``ptf<pid>x<random>-`` (the pid of
the process that made it), so concurrent runs never collide and
:func:`cleanup_leftovers` can remove the namespaces of runs whose process
died, and nothing that is not ours. Teardown deletes the namespaces (which
destroys their veths, bridge and qdiscs with them) on normal exit, on an
exception, on SIGTERM/SIGINT (the handlers raise, so ``with`` blocks unwind),
and at interpreter exit (``atexit``) as a last resort.

Needs root (CAP_NET_ADMIN) and iproute2; :func:`available` tells whether
namespaces work here.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from typing import Sequence

__all__ = ["SUBNET", "HOST_QUEUES", "EmulatedNetwork", "available", "cleanup_leftovers",
           "connection_leaf", "interface_bytes", "list_ours", "NetnsUnavailable"]

logger = logging.getLogger(__name__)

#: The only addresses used, and only inside this project's namespaces.
SUBNET = "10.213.7.0/24"
_NET_PREFIX = "10.213.7."
_PREFIX = "ptf"
_NAME_RE = re.compile(r"^ptf(\d+)x[0-9a-f]{4}-")
MAX_HOSTS = 200
#: How a host's end of its link queues what the host sends (module docstring).
HOST_QUEUES = ("fair", "fifo")
#: Leaf classes of the fair queue (a power of two: the hash takes top bits).
FAIR_BUCKETS = 256

_live: dict[str, "EmulatedNetwork"] = {}  # run id -> network, for atexit and signals
_live_lock = threading.Lock()


class NetnsUnavailable(RuntimeError):
    """Network namespaces or tc cannot be used here (not root, no iproute2...)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def available(need_latency: bool = False, need_fair_queue: bool = False) -> tuple[bool, str]:
    """Whether namespaces and tc (and with ``need_latency``, netem; with
    ``need_fair_queue``, HTB and the bpf classifier) work here:
    (True, "") or (False, why)."""
    if os.geteuid() != 0:
        return False, f"not root (euid {os.geteuid()}); network namespaces need CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{_PREFIX}{os.getpid()}x{secrets.token_hex(2)}-probe"
    try:
        proc = _ip("netns", "add", probe, check=False)
        if proc.returncode != 0:
            return False, f"`ip netns add` failed: {proc.stderr.strip()}"
        proc = _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                     "1gbit", "burst", "64kb", "latency", "10ms"], check=False)
        if proc.returncode != 0:
            return False, f"`tc qdisc add ... tbf` failed: {proc.stderr.strip()}"
        if need_latency:
            proc = _run(["tc", "-n", probe, "qdisc", "replace", "dev", "lo", "root", "netem",
                         "delay", "1ms"], check=False)
            if proc.returncode != 0:
                return False, (f"latency needs the netem qdisc, which this kernel lacks: "
                               f"{proc.stderr.strip()}")
        if need_fair_queue:
            _run(["tc", "-n", probe, "qdisc", "del", "dev", "lo", "root"], check=False)
            proc = _tc_batch(probe, _fair_queue("lo", "root", 1e9), check=False)
            if proc.returncode != 0:
                return False, (f"host_queue='fair' needs the htb qdisc and the bpf "
                               f"classifier: {proc.stderr.strip()}")
        return True, ""
    finally:
        _ip("netns", "del", probe, check=False)


def interface_bytes(pid: int, dev: str = "eth0") -> tuple[int, int] | None:
    """``(received, sent)`` bytes of interface ``dev`` in the network namespace
    of process ``pid`` (``/proc/PID/net/dev``: no subprocess, no setns), or
    None once the process is gone or the namespace has no ``dev``.

    The kernel counts each packet it hands the device with its Ethernet, IP
    and TCP headers; a segmentation-offloaded packet counts its headers once.
    """
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines[2:]:  # two header lines
        name, _, fields = line.partition(":")
        if name.strip() == dev:
            values = fields.split()
            return int(values[0]), int(values[8])
    return None


def list_ours() -> list[str]:
    """Namespaces whose names this module makes (any run)."""
    proc = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if _NAME_RE.match(n)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers() -> list[str]:
    """Deletes namespaces left behind by runs whose process is gone.

    Only names made by this module (``ptf<pid>x<hex>-...``) whose process is
    no longer alive are touched; live runs (this one included) are kept.
    Processes still inside a deleted namespace are ended by their pid.

    Returns:
      The deleted namespaces.
    """
    removed = []
    for name in list_ours():
        pid = int(_NAME_RE.match(name).group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        _delete_namespace(name)
        removed.append(name)
    if removed:
        logger.info("removed %d leftover namespace(s): %s", len(removed), ", ".join(removed))
    return removed


def _delete_namespace(name: str) -> None:
    proc = _ip("netns", "pids", name, check=False)
    for pid in (int(p) for p in proc.stdout.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", name, check=False)


def _tbf_sizes(rate_bits: float) -> tuple[int, int]:
    """(burst, queue limit) in bytes for a shaper of ``rate_bits``."""
    rate_bytes = rate_bits / 8
    # Burst: at least one GSO packet (64 KiB) plus slack, and 1 ms of traffic
    # at high rates so the kernel timer tick does not cap the rate. Queue: 50
    # ms of traffic (at least 256 KiB) so TCP sees delay before it sees loss.
    return max(96 * 1024, int(rate_bytes * 0.001)), max(256 * 1024, int(rate_bytes * 0.05))


def _tbf(rate_bits: float) -> list[str]:
    burst, limit = _tbf_sizes(rate_bits)
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst), "limit", str(limit)]


#: Fibonacci hashing of the ports word: its top bits are well mixed.
_HASH_MULTIPLIER = 2654435761
_HASH_SHIFT = 32 - (FAIR_BUCKETS.bit_length() - 1)  # keeps log2(FAIR_BUCKETS) top bits


def connection_leaf(source_port: int, destination_port: int) -> int:
    """The fair queue's leaf class (1..FAIR_BUCKETS) of a TCP packet with
    these ports: what the classifier of :func:`_connection_hash` computes."""
    key = (source_port << 16 | destination_port) * _HASH_MULTIPLIER % (1 << 32)
    return (key >> _HASH_SHIFT) + 1


def _connection_hash(handle: int) -> str:
    """A classic BPF program (``tc`` bytecode) that sends a TCP packet to
    leaf class ``handle``:(1 + hash of its ports) and anything else to the
    extra leaf ``FAIR_BUCKETS + 1``. The packet starts at its Ethernet header
    (14 bytes) and an IPv4 header without options (20 bytes: Linux TCP
    sets none), so the ports are the word at byte 34."""
    program = [
        (0x30, 0, 0, 23),                     # ldb [23]: the IP protocol
        (0x15, 0, 6, 6),                      # jeq #6 (TCP), else the last line
        (0x20, 0, 0, 34),                     # ld [34]: source port << 16 | dest port
        (0x24, 0, 0, _HASH_MULTIPLIER),       # mul
        (0x74, 0, 0, _HASH_SHIFT),            # rsh: the top bits
        (0x04, 0, 0, 1),                      # add #1: leaves are 1..buckets
        (0x44, 0, 0, handle << 16),           # or: class id handle:leaf
        (0x16, 0, 0, 0),                      # ret a
        (0x06, 0, 0, handle << 16 | (FAIR_BUCKETS + 1)),  # ret #handle:(FAIR_BUCKETS + 1)
    ]
    return f"{len(program)}," + ",".join(f"{c} {jt} {jf} {k}" for c, jt, jf, k in program)


def _fair_queue(dev: str, parent: str, rate_bits: float, handle: int = 1) -> list[str]:
    """``tc -batch`` lines for the fair host queue at ``parent`` of ``dev``:
    an HTB class of ``rate_bits`` whose :data:`FAIR_BUCKETS` + 1 leaves each
    get an equal part and may borrow the rest, so active connections share
    the link in turn (HTB's deficit round robin), each leaf with a queue as
    deep as ``tbf``'s."""
    burst, limit = _tbf_sizes(rate_bits)
    rate = int(rate_bits)
    leaves = FAIR_BUCKETS + 1
    lines = [f"qdisc add dev {dev} {parent} handle {handle:x}: htb default {leaves:x}",
             f"class add dev {dev} parent {handle:x}: classid {handle:x}:ffff htb rate {rate}bit "
             f"ceil {rate}bit burst {burst} cburst {burst}"]
    for leaf in range(1, leaves + 1):
        lines.append(f"class add dev {dev} parent {handle:x}:ffff classid {handle:x}:{leaf:x} "
                     f"htb rate {max(rate // leaves, 8000)}bit ceil {rate}bit burst {burst} "
                     f"cburst {burst} quantum 65536")
        lines.append(f"qdisc add dev {dev} parent {handle:x}:{leaf:x} bfifo limit {limit}")
    lines.append(f'filter add dev {dev} parent {handle:x}: prio 1 protocol ip bpf bytecode '
                 f'"{_connection_hash(handle)}"')
    return lines


def _tc_batch(namespace: str, lines: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["tc", "-n", namespace, "-batch", "-"], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"tc -n {namespace} -batch failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


class EmulatedNetwork:
    """``num_hosts`` hosts in their own namespaces, each with a shaped link to a bridge.

    Use as a context manager; :meth:`close` is idempotent.

    Args:
      num_hosts: hosts to make (1 to :data:`MAX_HOSTS`).
      bandwidth_mbit: each link's rate in Mbit/s, each direction; None = unshaped.
      latency_ms: one-way delay added on each host's outgoing side (0 = none).
      host_queue: how a host's end of its link queues what it sends, one of
        :data:`HOST_QUEUES` ("fair": connections in turn; "fifo": one queue).

    Raises:
      ValueError: bad counts or rates (nothing is created).
      NetnsUnavailable: namespaces cannot be made here (see :func:`available`).
    """

    def __init__(self, num_hosts: int, bandwidth_mbit: float | None, latency_ms: float = 0.0,
                 host_queue: str = "fair"):
        if not isinstance(num_hosts, int) or not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be an int in [1, {MAX_HOSTS}]. "
                             f"Received: num_hosts={num_hosts!r}")
        if bandwidth_mbit is not None and not bandwidth_mbit > 0:
            raise ValueError(f"bandwidth_mbit must be positive (or None for unshaped). "
                             f"Received: bandwidth_mbit={bandwidth_mbit!r}")
        if not latency_ms >= 0:
            raise ValueError(f"latency_ms must be >= 0. Received: latency_ms={latency_ms!r}")
        if host_queue not in HOST_QUEUES:
            raise ValueError(f"host_queue must be one of {HOST_QUEUES}. "
                             f"Received: host_queue={host_queue!r}")
        self.num_hosts = num_hosts
        self.host_queue = host_queue
        self.bandwidth_mbit = bandwidth_mbit
        self.latency_ms = float(latency_ms)
        self.run_id = f"{_PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.bridge_ns = f"{self.run_id}-br"
        self.hosts = [f"{self.run_id}-h{i}" for i in range(num_hosts)]
        self.addresses = [f"{_NET_PREFIX}{i + 1}" for i in range(num_hosts)]
        self._made: list[str] = []
        self._closed = False
        self._previous_handlers: dict = {}

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> "EmulatedNetwork":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Creates the namespaces, links and shaping; on any failure removes them."""
        ok, why = available(need_latency=self.latency_ms > 0,
                            need_fair_queue=self._fair_host_queue)
        if not ok:
            raise NetnsUnavailable(why)
        with _live_lock:
            if not _live:
                atexit.register(_close_all)
            _live[self.run_id] = self
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        logger.info("emulated network %s: %d hosts, %s Mbit/s per link, latency %g ms, "
                    "host queue %s", self.run_id, self.num_hosts,
                    self.bandwidth_mbit or "unshaped", self.latency_ms, self.host_queue)

    @property
    def _fair_host_queue(self) -> bool:
        return self.host_queue == "fair" and self.bandwidth_mbit is not None

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
        for i, (host, address) in enumerate(zip(self.hosts, self.addresses)):
            self._add_ns(host)
            port = f"h{i}"
            # Both ends are created directly in their namespaces: the root
            # namespace never holds an interface of ours.
            _ip("link", "add", "name", "eth0", "netns", host, "type", "veth",
                "peer", "name", port, "netns", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", port, "up")
            _ip("-n", host, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")
            _ip("-n", host, "link", "set", "lo", "up")
            self._shape(host, "eth0", self.latency_ms, fair=self._fair_host_queue)
            self._shape(self.bridge_ns, port, 0.0, fair=False)

    def _shape(self, namespace: str, dev: str, latency_ms: float, fair: bool) -> None:
        base = ["tc", "-n", namespace, "qdisc", "add", "dev", dev]
        rate = None if self.bandwidth_mbit is None else self.bandwidth_mbit * 1e6
        parent, handle = "root", 1
        if latency_ms > 0:
            limit = 100_000  # packets; netem's default of 1000 would drop at high rates
            _run(base + ["root", "handle", "1:", "netem", "delay", f"{latency_ms}ms",
                         "limit", str(limit)])
            parent, handle = "parent 1:", 2
        if rate is None:
            return
        if fair:
            _tc_batch(namespace, _fair_queue(dev, parent, rate, handle))
        else:
            _run(base + [*parent.split(), "handle", f"{handle}:", *_tbf(rate)])

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        """Ends processes left in the namespaces and deletes the namespaces."""
        if self._closed:
            return
        self._closed = True
        for name in reversed(self._made):
            _delete_namespace(name)
        self._made.clear()
        with _live_lock:
            _live.pop(self.run_id, None)
        self._restore_signal_handlers()
        logger.info("emulated network %s removed", self.run_id)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Only the main thread may set handlers; atexit still cleans up.

        def raise_interrupt(signum, _frame):
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGINT):
            current = signal.getsignal(sig)
            if current in (signal.SIG_DFL, signal.default_int_handler):
                self._previous_handlers[sig] = current
                signal.signal(sig, raise_interrupt)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    # -- use ---------------------------------------------------------------------------

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` to run inside host ``host``'s namespace."""
        if not 0 <= host < self.num_hosts:
            raise ValueError(f"host must be in [0, {self.num_hosts}). Received: host={host!r}")
        return ["ip", "netns", "exec", self.hosts[host], *argv]

    def qdiscs(self) -> str:
        """``tc qdisc show`` of every shaped device (for logs and tests)."""
        lines = []
        for i, host in enumerate(self.hosts):
            lines.append(_run(["tc", "-n", host, "qdisc", "show", "dev", "eth0"]).stdout)
            lines.append(_run(["tc", "-n", self.bridge_ns, "qdisc", "show", "dev",
                               f"h{i}"]).stdout)
        return "".join(lines)


def _close_all() -> None:
    with _live_lock:
        networks = list(_live.values())
    for network in networks:
        try:
            network.close()
        except Exception:  # noqa: BLE001 - at exit, remove what can be removed.
            logger.exception("removing emulated network %s failed", network.run_id)
