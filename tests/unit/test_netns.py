"""The emulated cluster: namespaces, shaped links, and teardown in every case."""
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from prophet_tf.bench import link_probe, netns

ROOT = pathlib.Path(__file__).resolve().parents[2]
OK, WHY = netns.available()
needs_netns = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")


def _exists(name: str) -> bool:
    return name in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                  text=True).stdout.split()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [dict(num_hosts=0, bandwidth_mbit=10),
                                    dict(num_hosts=2, bandwidth_mbit=-1),
                                    dict(num_hosts=2, bandwidth_mbit=10, latency_ms=-5),
                                    dict(num_hosts=2, bandwidth_mbit=10, host_queue="lifo")])
def test_bad_arguments_are_rejected_before_anything_exists(kwargs):
    before = netns.list_ours()
    with pytest.raises(ValueError, match="Received"):
        netns.EmulatedNetwork(**kwargs)
    assert netns.list_ours() == before


@needs_netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize("host_queue", netns.HOST_QUEUES)
def test_network_is_shaped_and_removed(host_queue):
    with netns.EmulatedNetwork(2, 40, host_queue=host_queue) as net:
        names = [net.bridge_ns, *net.hosts]
        assert all(_exists(n) for n in names)
        qdiscs = net.qdiscs()
        if host_queue == "fifo":
            assert qdiscs.count("tbf") == 4 and "40Mbit" in qdiscs
        else:  # the bridge ends are one queue each, the host ends fair queues
            assert qdiscs.count("tbf") == 2 and qdiscs.count("qdisc htb") == 2
            assert qdiscs.count("bfifo") == 2 * (netns.FAIR_BUCKETS + 1)
        # 1 MB from host 0 to host 1 over two 40 Mbit/s links takes >= 0.2 s.
        server = subprocess.Popen(net.command(1, [sys.executable, "-c", textwrap.dedent(f"""
            import socket
            s = socket.socket(); s.bind(("{net.addresses[1]}", 5001)); s.listen(1)
            print("ready", flush=True)
            c, _ = s.accept(); n = 0
            while d := c.recv(1 << 16): n += len(d)
            print(n, flush=True)
            input()  # Stays in its namespace until killed: its interface is read after.
            """)]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            received_before, _ = netns.interface_bytes(server.pid)
            t0 = time.monotonic()
            subprocess.run(net.command(0, [sys.executable, "-c", textwrap.dedent(f"""
                import socket
                c = socket.create_connection(("{net.addresses[1]}", 5001))
                c.sendall(b"x" * 1_000_000); c.close()""")]), check=True, timeout=30)
            assert server.stdout.readline().strip() == "1000000"
            elapsed = time.monotonic() - t0
            # Host 1's interface counted the megabyte and its headers, and nothing else.
            received = netns.interface_bytes(server.pid)[0] - received_before
        finally:
            server.kill()
            server.wait()
        assert elapsed >= 1_000_000 * 8 / 40e6 * 0.9, elapsed
        assert 1_000_000 < received < 1_000_000 * 1.1, received
        assert netns.interface_bytes(server.pid) is None  # the process is gone
    assert not any(_exists(n) for n in names)


@needs_netns
@pytest.mark.timeout(90)
def test_fair_host_queue_shares_the_uplink_between_connections():
    # Host 0 keeps two connections to each other host busy with 256 KiB
    # messages, each sent when the one before is acknowledged (a push's
    # pattern). Its fair queue puts each connection in a leaf class of its
    # own, all of one rate and free to borrow the whole link, and serves
    # them in turn (HTB's round robin). (Through one queue, TCP leaves some
    # connections a fifth of their share for seconds: benchmarks/
    # flow_share.py, which also measures how even the shares are here;
    # they move with how promptly this machine runs the senders, so they
    # are not bounded here.) The source ports are chosen to land in
    # different leaves.
    ports, leaves = [], set()
    for port in range(41000, 42000):
        if netns.connection_leaf(port, link_probe.PORT) not in leaves:
            leaves.add(netns.connection_leaf(port, link_probe.PORT))
            ports.append(port)
        if len(ports) == 6:
            break
    with netns.EmulatedNetwork(4, 125) as net, link_probe.receiving(net, 1 << 18):
        spans = link_probe.send_messages(net, 1 << 18, 3.0, net.addresses[1:] * 2,
                                         source_ports=ports)
        classes = subprocess.run(["tc", "-s", "-n", net.hosts[0], "class", "show", "dev",
                                  "eth0"], capture_output=True, text=True, check=True).stdout
    stats = {int(leaf, 16): (rate, ceil, int(sent)) for leaf, rate, ceil, sent in re.findall(
        r"class htb 1:([0-9a-f]+) parent 1:ffff .*?rate (\S+) ceil (\S+) .*?\n\s*Sent (\d+) bytes",
        classes)}
    assert len(stats) == netns.FAIR_BUCKETS + 1, classes
    assert len({(rate, ceil) for rate, ceil, _ in stats.values()}) == 1, classes
    assert all(ceil == "125Mbit" for _, ceil, _ in stats.values()), classes
    # Each connection's messages (payload; the wire adds headers) left
    # through its own leaf, and no TCP packet through any other.
    messages = [sum(1 for *_, i in spans if i == connection) for connection in range(6)]
    assert all(n > 0 for n in messages), messages
    own = [netns.connection_leaf(port, link_probe.PORT) for port in ports]
    for leaf, n in zip(own, messages):
        assert stats[leaf][2] >= n << 18, (leaf, n, stats[leaf])
    others = [sent for leaf, (*_, sent) in stats.items()
              if leaf not in own and leaf != netns.FAIR_BUCKETS + 1]
    assert sum(others) == 0, others


def test_a_probe_needs_one_source_port_per_destination():
    with pytest.raises(ValueError, match="Received: \\[41000\\]"):
        link_probe.send_messages(None, 1 << 10, 1.0, ["10.0.0.2", "10.0.0.3"],
                                 source_ports=[41000])


@needs_netns
@pytest.mark.timeout(60)
def test_removed_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.EmulatedNetwork(2, 100) as net:
            names = [net.bridge_ns, *net.hosts]
            assert all(_exists(n) for n in names)
            raise RuntimeError("boom")
    assert not any(_exists(n) for n in names)


@needs_netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_removed_when_the_process_is_signalled(sig):
    # A background job of a non-interactive shell starts with SIGINT ignored,
    # and the network rightly keeps an ignored signal ignored: the child takes
    # the default disposition, as a program started from a terminal has.
    code = textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from prophet_tf.bench import netns
        with netns.EmulatedNetwork(2, 100) as net:
            print(" ".join([net.bridge_ns, *net.hosts]), flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        names = proc.stdout.readline().split()
        assert names and all(_exists(n) for n in names)
        proc.send_signal(sig)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not any(_exists(n) for n in names)


@needs_netns
@pytest.mark.timeout(60)
def test_cleanup_removes_only_dead_runs():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"ptf{dead.pid}x0000-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with netns.EmulatedNetwork(1, 100) as live:
            removed = netns.cleanup_leftovers()
            assert stale in removed and not _exists(stale)
            assert _exists(live.hosts[0])  # this process's run is kept
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


@needs_netns
@pytest.mark.timeout(60)
def test_latency_without_netem_is_a_clear_error_or_works():
    before = set(netns.list_ours())
    has_netem, why = netns.available(need_latency=True)
    if has_netem:
        with netns.EmulatedNetwork(2, 100, latency_ms=2) as net:
            assert "netem" in net.qdiscs()
    else:
        with pytest.raises(netns.NetnsUnavailable, match="netem"):
            netns.EmulatedNetwork(2, 100, latency_ms=2).open()
    assert set(netns.list_ours()) == before


@pytest.mark.timeout(60)
def test_transport_shaping_fallback_paces_pushes(monkeypatch):
    """Without namespaces the bench sets PROPHET_TF_SHAPE_MBIT: the strategy hands the
    engine shaping.from_env, whose buckets pace each PS client's pushes."""
    import numpy as np

    from prophet_tf.ps import shaping
    from prophet_tf.ps.client import Chunk, PSClient
    monkeypatch.setenv("PROPHET_TF_SHAPE_MBIT", "80")  # 10 MB/s
    client = PSClient("127.0.0.1:1", worker_id=0, num_workers=1,  # nothing listens: not needed
                      shapers=shaping.from_env())
    try:
        chunk = Chunk(0, 0, 0, np.zeros(250_000, np.float32))  # 1 MB
        t0 = time.monotonic()
        futures = [client.push_future([chunk], timeout=0.01) for _ in range(3)]
        elapsed = time.monotonic() - t0
        for f in futures:
            f.cancel()
    finally:
        client.close()
    assert elapsed >= 0.27, elapsed  # 3 MB at 10 MB/s (0.3 s) less the 64 KiB burst
