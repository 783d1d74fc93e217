"""What the link benchmarks (``link_rate.py``, ``flow_share.py``) share: the
bench's emulated network of 4 hosts, host 0 sending to hosts 1-3, its
``--host-queue`` and the time TCP takes to settle. The programs they run on
the hosts are in ``prophet_tf.bench.link_probe`` (flow_share's, which the
tests share) or their own (link_rate's)."""
import contextlib
import sys

from prophet_tf.bench import link_probe, netns

#: Seconds before measuring: TCP's slow start and the shaper's queue fill.
SETTLE_S = 3.0


def add_host_queue_argument(parser) -> None:
    """``--host-queue``: how host 0 queues what it sends."""
    parser.add_argument("--host-queue", default="fair", choices=netns.HOST_QUEUES,
                        help="how host 0 queues what it sends (prophet_tf.bench.netns)")


def unavailable(script: str, host_queue: str = "fair") -> bool:
    """True (and says why on stderr) where the emulated network cannot be built."""
    ok, why = netns.available(need_fair_queue=host_queue == "fair")
    if not ok:
        print(f"{script}: needs the emulated network: {why}", file=sys.stderr)
    return not ok


@contextlib.contextmanager
def receiving(mbit: float, receiver: str, *args: str, host_queue: str = "fair"):
    """4 emulated hosts with links of ``mbit`` (and ``host_queue``, see
    ``netns``), the Python code ``receiver`` (given ``args``) running on
    hosts 1, 2 and 3; yields the network."""
    with netns.EmulatedNetwork(4, mbit, host_queue=host_queue) as net, \
            link_probe.running(net, receiver, *args):
        yield net


def command(script: str, argv) -> str:
    """The command line that ran ``script``, for its JSON."""
    return f"python benchmarks/{script} " + " ".join(argv if argv is not None else sys.argv[1:])
