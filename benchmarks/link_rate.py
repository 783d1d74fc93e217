"""How much of an emulated link's payload rate bulk TCP gets.

    python benchmarks/link_rate.py [--mbit 125] [--seconds 6] [--host-queue fair|fifo] \
        [--json OUT]

Builds the bench's emulated network (``prophet_tf.bench.netns``: 4 hosts,
links shaped both ways, host 0's sends through ``--host-queue``), then sends bulk TCP from host 0 to
host 1 (one flow), and to hosts 1, 2 and 3 at once (three flows, as a
worker's pushes to three PS tasks), and reads host 0's interface counter
over the steady part of each. The load is what ``link_load`` reports for a
bench run: the interface's bytes over the link's payload rate (the ideal
bound's B). A run's links that stay below this while they have bytes to
send lose the time to the exchange, not to the shaper. Needs root.
"""
import argparse
import json
import subprocess
import sys
import time

from emulated_hosts import (SETTLE_S, add_host_queue_argument, command, receiving,
                            unavailable)
from prophet_tf.bench import ideal, netns

PORT = 5000

RECEIVER = f"""
import socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT}))
s.listen(8)
def drain(c):
    while c.recv(1 << 20):
        pass
while True:
    c, _ = s.accept()
    threading.Thread(target=drain, args=(c,), daemon=True).start()
"""

SENDER = f"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], {PORT}))
block = b"x" * (1 << 20)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    c.sendall(block)
"""


def measure(net: "netns.EmulatedNetwork", flows: int, seconds: float, rate: float) -> float:
    """Host 0's uplink load while it sends ``flows`` bulk flows."""
    senders = [subprocess.Popen(net.command(0, [sys.executable, "-c", SENDER,
                                                net.addresses[h], str(SETTLE_S + seconds + 1)]))
               for h in range(1, flows + 1)]
    try:
        time.sleep(SETTLE_S)
        (_, sent0), t0 = netns.interface_bytes(senders[0].pid), time.monotonic()
        time.sleep(seconds)
        (_, sent1), t1 = netns.interface_bytes(senders[0].pid), time.monotonic()
    finally:
        for p in senders:
            p.wait(SETTLE_S + seconds + 30)
    return (sent1 - sent0) / ((t1 - t0) * rate)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbit", type=float, default=125.0, help="link rate, Mbit/s")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured span per case")
    add_host_queue_argument(parser)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    if unavailable("link_rate.py", args.host_queue):
        return 2
    rate = ideal.payload_bytes_per_s(args.mbit)
    loads = {}
    with receiving(args.mbit, RECEIVER, host_queue=args.host_queue) as net:
        for flows in (1, 3):
            loads[flows] = measure(net, flows, args.seconds, rate)
            print(f"{flows} flow(s): host 0's uplink at {loads[flows]:.3f} of the "
                  f"payload rate", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command("link_rate.py", argv), "link_mbit": args.mbit,
                       "host_queue": args.host_queue,
                       "payload_bytes_per_s": rate, "measured_s": args.seconds,
                       "load_by_flows": {str(k): v for k, v in loads.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
