"""How evenly TCP connections share an emulated link, message by message.

    python benchmarks/flow_share.py [--mbit 125] [--kib 256] [--seconds 20] [--reps 3] \
        [--congestion NAME] [--host-queue fair|fifo] [--json OUT]

Builds the bench's emulated network (``prophet_tf.bench.netns``: 4 hosts,
links shaped both ways; ``--host-queue`` says how host 0 queues what it
sends, ``fair`` by default). Host 0 then keeps K connections busy at
once, to hosts 1, 2 and 3 in turn (K = 2: a host's pushes and answers with
2 workers; K = 3: a worker's pushes to three PS tasks; K = 6: those and its
PS's answers to three workers, which share the same uplink). Each
connection sends a message of the given size, waits for a one-byte reply,
and sends the next, as a push does. Every message's rate is its bytes over
its time; against the fair share (the link's payload rate / K) it gives
how unevenly the connections shared the link while it crossed. Even
sharing puts every message at 1.0; TCP through one shaped queue
(``--host-queue fifo``) takes turns instead, most messages faster than
that and some far slower. The
simulator draws each message's weight from a log-normal
distribution; ``share_sigma`` is the sigma whose simulated messages have the
measured median (``simulate_flow_share.fit_share_sigma``), and ``prophet-tf simulate
--validate --flow-share OUT`` uses it.

Turns can last: each run also records every connection's share of the
messages (``connection_shares_by_run``: 1.0 each for an even run, a
connection starved for the whole run near 0), and what host 0's shaper
dropped and its TCP retransmitted. ``--congestion`` sets the senders' TCP
congestion control (default: the machine's, recorded in the JSON). Needs
root.
"""
import argparse
import json
import math
import re
import statistics
import subprocess
import sys

from emulated_hosts import SETTLE_S, add_host_queue_argument, command, unavailable
from prophet_tf.bench import ideal, link_probe, netns, simulate_flow_share


def measure(net: "netns.EmulatedNetwork", flows: int, size: int, seconds: float,
            congestion: str) -> dict:
    """Each message's time (s) and connection while host 0 keeps ``flows``
    connections busy, and what host 0's shaper dropped and its TCP
    retransmitted meanwhile."""
    hosts = [net.addresses[1 + i % 3] for i in range(flows)]
    before = _losses(net)
    spans = link_probe.send_messages(net, size, SETTLE_S + seconds, hosts,
                                     congestion=congestion)
    dropped, retransmitted = (a - b for a, b in zip(_losses(net), before))
    begin = spans[0][0] + SETTLE_S
    stop = max(end for _, end, _ in spans) - 1.0  # the last messages run with fewer flows
    kept = [(end - start, index) for start, end, index in spans if begin <= start and end <= stop]
    return {"times": [t for t, _ in kept], "connections": [i for _, i in kept],
            "flows": flows, "dropped": dropped, "retransmitted": retransmitted}


def _losses(net: "netns.EmulatedNetwork") -> tuple:
    """Packets host 0's shaper has dropped and segments its TCP has
    retransmitted so far (both count from the host's creation)."""
    qdisc = subprocess.run(["tc", "-s", "-n", net.hosts[0], "qdisc", "show", "dev", "eth0"],
                           capture_output=True, text=True, check=True).stdout
    dropped = sum(int(n) for n in re.findall(r"dropped (\d+)", qdisc))
    snmp = subprocess.run(net.command(0, ["cat", "/proc/net/snmp"]), capture_output=True,
                          text=True, check=True).stdout
    names, values = [line.split()[1:] for line in snmp.splitlines() if line.startswith("Tcp:")]
    return dropped, int(values[names.index("RetransSegs")])


def connection_shares(run: dict) -> list:
    """Each connection's messages over an even share of the run's messages,
    slowest first: 1.0 each when the link was shared evenly all along."""
    counts = [run["connections"].count(i) for i in range(run["flows"])]
    even = sum(counts) / run["flows"]
    return sorted(round(c / even, 2) for c in counts)


def summary(runs: list, flows: int, size: int, rate: float) -> dict:
    """The runs' messages pooled (runs of one case can differ, one sharing
    evenly, another taking turns: each run's median is kept too), and how
    the messages were spread over the connections, run by run."""
    fair_s = size / (rate / flows)  # a message's time at the fair share
    times = [t for run in runs for t in run["times"]]
    ratios = [fair_s / t for t in times]
    median = statistics.median(ratios)
    return {"messages": len(ratios), "median_ratio": median,
            "median_ratio_by_run": [round(statistics.median(fair_s / t for t in run["times"]), 3)
                                    for run in runs],
            "log_sigma": statistics.pstdev(math.log(r) for r in ratios),
            "duration_deciles_ms": [round(q * 1e3, 1)
                                    for q in statistics.quantiles(times, n=10)],
            "connection_shares_by_run": [connection_shares(run) for run in runs],
            "dropped_packets": sum(run["dropped"] for run in runs),
            "retransmitted_segments": sum(run["retransmitted"] for run in runs),
            # Below 1: no turns to model (the link lost rate instead).
            "share_sigma": simulate_flow_share.fit_share_sigma(min(median, 0.99 * flows), flows)
            if median >= 1.0 else 0.0}


def congestion_control(name: str | None) -> str:
    """``name`` if this kernel offers it (the machine's default for None)."""
    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        available = f.read().split()
    if name is None:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    if name not in available:
        raise SystemExit(f"flow_share.py: --congestion must be one of {available}. "
                         f"Received: {name!r}")
    return name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbit", type=float, default=125.0, help="link rate, Mbit/s")
    parser.add_argument("--kib", type=int, default=256, help="message size, KiB")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured span per case")
    parser.add_argument("--reps", type=int, default=3, help="runs per case, pooled")
    parser.add_argument("--congestion", default=None,
                        help="the senders' TCP congestion control (default: the machine's)")
    add_host_queue_argument(parser)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    congestion = congestion_control(args.congestion)
    if unavailable("flow_share.py", args.host_queue):
        return 2
    rate = ideal.payload_bytes_per_s(args.mbit)
    size = args.kib * 1024
    runs: dict = {}
    with netns.EmulatedNetwork(4, args.mbit, host_queue=args.host_queue) as net, \
            link_probe.receiving(net, size):
        for _ in range(args.reps):  # interleaved, so a slow spell hits every case
            for flows in (2, 3, 6):
                runs.setdefault(flows, []).append(measure(net, flows, size, args.seconds,
                                                          congestion))
    cases = {flows: summary(case_runs, flows, size, rate) for flows, case_runs in runs.items()}
    for flows, c in cases.items():
        print(f"{flows} connections: {c['messages']} messages, rate / fair share: "
              f"median {c['median_ratio']:.3f} (by run {c['median_ratio_by_run']}), "
              f"sigma of log {c['log_sigma']:.3f}; "
              f"durations' deciles {c['duration_deciles_ms']} ms; "
              f"connections' shares by run {c['connection_shares_by_run']}; "
              f"dropped {c['dropped_packets']}, retransmitted {c['retransmitted_segments']}; "
              f"share_sigma {c['share_sigma']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command("flow_share.py", argv), "link_mbit": args.mbit,
                       "congestion": congestion, "host_queue": args.host_queue,
                       "message_bytes": size, "payload_bytes_per_s": rate,
                       "measured_s": args.seconds, "reps": args.reps,
                       "by_connections": {str(k): v for k, v in cases.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
