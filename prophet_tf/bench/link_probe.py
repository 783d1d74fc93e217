"""Message-by-message TCP probes of the emulated network (``netns``).

A push's traffic pattern: each connection sends a message, waits for a
one-byte answer, and sends the next. ``benchmarks/flow_share.py`` measures
how evenly such connections share a link with it, and the netns tests check
the fair host queue with it. Both run the same two small programs, one per
emulated host, so what the benchmark reports is what the test asserts.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time

__all__ = ["PORT", "receiving", "running", "send_messages"]

PORT = 5001

#: Reads messages of argv[1] bytes on every connection, answers each with b"k".
_RECEIVER = f"""
import socket, sys, threading
size = int(sys.argv[1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT}))
s.listen(16)
def serve(c):
    buf = bytearray(1 << 20)
    while True:
        left = size
        while left:
            n = c.recv_into(buf, min(left, len(buf)))
            if not n:
                return
            left -= n
        c.sendall(b"k")
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

#: argv: size, seconds, congestion control ("" keeps the machine's), then
#: host:source_port per connection (source port 0: any). One thread per
#: connection; prints "start end connection" (monotonic s, the connection's
#: index) per message.
_SENDER = f"""
import socket, sys, threading, time
size, seconds, congestion = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
message = b"x" * size
end = time.monotonic() + seconds
lines = []
def run(index, destination):
    host, port = destination.rsplit(":", 1)
    c = socket.socket()
    if congestion:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.bind(("0.0.0.0", int(port)))
    c.connect((host, {PORT}))
    while time.monotonic() < end:
        t0 = time.monotonic()
        c.sendall(message)
        if c.recv(1) != b"k":
            raise SystemExit("receiver closed")
        lines.append(f"{{t0}} {{time.monotonic()}} {{index}}")
threads = [threading.Thread(target=run, args=(i, d)) for i, d in enumerate(sys.argv[4:])]
for t in threads: t.start()
for t in threads: t.join()
print("\\n".join(lines))
"""


@contextlib.contextmanager
def running(net, code: str, *args: str, hosts=None):
    """The Python program ``code`` (given ``args``) running on ``hosts`` of
    ``net`` (all but host 0 by default) until the block ends; it has a
    second to start listening."""
    hosts = range(1, len(net.hosts)) if hosts is None else hosts
    procs = [subprocess.Popen(net.command(h, [sys.executable, "-c", code, *args]))
             for h in hosts]
    try:
        time.sleep(1.0)  # until they listen
        yield net
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def receiving(net, message_bytes: int, hosts=None):
    """Receivers of ``message_bytes`` messages on ``hosts`` of ``net`` (all
    but host 0 by default), answering each on ``PORT`` until the block ends."""
    return running(net, _RECEIVER, str(message_bytes), hosts=hosts)


def send_messages(net, message_bytes: int, seconds: float, destinations, *,
                  congestion: str = "", source_ports=None) -> list[tuple[float, float, int]]:
    """From host 0 of ``net``, one connection per address in
    ``destinations`` (each bound to its ``source_ports`` entry, if given),
    each sending ``message_bytes`` messages back to back for ``seconds``;
    returns every message's (start, end, connection index), sorted by start.

    Raises:
      ValueError: ``source_ports`` does not give one port per destination.
    """
    destinations = list(destinations)
    ports = [0] * len(destinations) if source_ports is None else list(source_ports)
    if len(ports) != len(destinations):
        raise ValueError(f"one source port per destination: {len(destinations)} destinations. "
                         f"Received: {ports!r}")
    argv = [str(message_bytes), str(seconds), congestion] + \
        [f"{host}:{port}" for host, port in zip(destinations, ports)]
    sender = subprocess.run(net.command(0, [sys.executable, "-c", _SENDER] + argv),
                            capture_output=True, text=True, timeout=seconds + 60, check=True)
    return sorted((float(start), float(end), int(index)) for start, end, index in
                  (line.split() for line in sender.stdout.split("\n") if line))
