"""How evenly TCP connections share an emulated link, message by message.

    python benchmarks/flow_share.py [--mbit 125] [--kib 256] [--seconds 20] [--reps 3] \
        [--json OUT]

Builds the bench's emulated network (``prophet_tf.bench.netns``: 4 hosts,
links shaped by ``tbf`` both ways). Host 0 then keeps K connections busy at
once, to hosts 1, 2 and 3 in turn (K = 2: a host's pushes and answers with
2 workers; K = 3: a worker's pushes to three PS tasks; K = 6: those and its
PS's answers to three workers, which share the same uplink). Each
connection sends a message of the given size, waits for a one-byte reply,
and sends the next, as a push does. Every message's rate is its bytes over
its time; against the fair share (the link's payload rate / K) it gives
how unevenly the connections shared the link while it crossed. Even
sharing puts every message at 1.0; TCP through the shaper takes turns
instead, most messages faster than that and some far slower. The
simulator draws each message's weight from a log-normal
distribution; ``share_sigma`` is the sigma whose simulated messages have the
measured median (``simulate.fit_share_sigma``), and ``prophet-tf simulate
--validate --flow-share OUT`` uses it. Needs root.
"""
import argparse
import json
import math
import statistics
import subprocess
import sys

from emulated_hosts import SETTLE_S, command, receiving, unavailable
from prophet_tf.bench import ideal, netns, simulate

PORT = 5001

RECEIVER = f"""
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

#: One thread per connection; prints "start end" (monotonic s) per message.
SENDER = f"""
import socket, sys, threading, time
size, seconds, hosts = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
message = b"x" * size
end = time.monotonic() + seconds
lines = []
def run(host):
    c = socket.create_connection((host, {PORT}))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while time.monotonic() < end:
        t0 = time.monotonic()
        c.sendall(message)
        if c.recv(1) != b"k":
            raise SystemExit("receiver closed")
        lines.append(f"{{t0}} {{time.monotonic()}}")
threads = [threading.Thread(target=run, args=(h,)) for h in hosts]
for t in threads: t.start()
for t in threads: t.join()
print("\\n".join(lines))
"""


def measure(net: "netns.EmulatedNetwork", flows: int, size: int, seconds: float) -> list:
    """Each message's time (s) while host 0 keeps ``flows`` connections busy."""
    hosts = [net.addresses[1 + i % 3] for i in range(flows)]
    sender = subprocess.run(net.command(0, [sys.executable, "-c", SENDER, str(size),
                                            str(SETTLE_S + seconds)] + hosts),
                            capture_output=True, text=True, timeout=SETTLE_S + seconds + 60,
                            check=True)
    spans = sorted(tuple(map(float, line.split())) for line in sender.stdout.split("\n") if line)
    begin = spans[0][0] + SETTLE_S
    stop = max(end for _, end in spans) - 1.0  # the last messages run with fewer flows
    return [end - start for start, end in spans if begin <= start and end <= stop]


def summary(runs: list, flows: int, size: int, rate: float) -> dict:
    """The runs' messages pooled (runs of one case can differ, one sharing
    evenly, another taking turns: each run's median is kept too)."""
    fair_s = size / (rate / flows)  # a message's time at the fair share
    times = [t for run in runs for t in run]
    ratios = [fair_s / t for t in times]
    median = statistics.median(ratios)
    return {"messages": len(ratios), "median_ratio": median,
            "median_ratio_by_run": [round(statistics.median(fair_s / t for t in run), 3)
                                    for run in runs],
            "log_sigma": statistics.pstdev(math.log(r) for r in ratios),
            "duration_deciles_ms": [round(q * 1e3, 1)
                                    for q in statistics.quantiles(times, n=10)],
            # Below 1: no turns to model (the link lost rate instead).
            "share_sigma": simulate.fit_share_sigma(min(median, 0.99 * flows), flows)
            if median >= 1.0 else 0.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbit", type=float, default=125.0, help="link rate, Mbit/s")
    parser.add_argument("--kib", type=int, default=256, help="message size, KiB")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured span per case")
    parser.add_argument("--reps", type=int, default=3, help="runs per case, pooled")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    if unavailable("flow_share.py"):
        return 2
    rate = ideal.payload_bytes_per_s(args.mbit)
    size = args.kib * 1024
    runs: dict = {}
    with receiving(args.mbit, RECEIVER, str(size)) as net:
        for _ in range(args.reps):  # interleaved, so a slow spell hits every case
            for flows in (2, 3, 6):
                runs.setdefault(flows, []).append(measure(net, flows, size, args.seconds))
    cases = {flows: summary(case_runs, flows, size, rate) for flows, case_runs in runs.items()}
    for flows, c in cases.items():
        print(f"{flows} connections: {c['messages']} messages, rate / fair share: "
              f"median {c['median_ratio']:.3f} (by run {c['median_ratio_by_run']}), "
              f"sigma of log {c['log_sigma']:.3f}; "
              f"durations' deciles {c['duration_deciles_ms']} ms; "
              f"share_sigma {c['share_sigma']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command("flow_share.py", argv), "link_mbit": args.mbit,
                       "message_bytes": size, "payload_bytes_per_s": rate,
                       "measured_s": args.seconds, "reps": args.reps,
                       "by_connections": {str(k): v for k, v in cases.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
