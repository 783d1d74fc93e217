"""Scheduler decision time per gradient (goal for prophet: <= 20 us).

Drives each scheduler over a synthetic ResNet-50-like workload in virtual time
and times only the scheduler's own calls (add + next_block + on_sent, with a
perf_counter_ns pair around each, ~0.1 us, included), amortised per gradient
(161 gradients per iteration; P3 sees more items, its 200 KB slices).

Workload: ResNet-50's 161 trainable variables in forward order (53 conv
kernels, 53 BatchNorm gamma/beta pairs, the 2048x1000 classifier; float32,
~102 MB). Backprop lasts ``--backward-ms`` and produces gradients in bursts,
one per residual block (plus stem and classifier), each burst after a pause
proportional to the block's FLOPs, with 0-50 us jitter per gradient. Forward
takes half of backprop; layer i's forward waits until its gradient of the
previous iteration has been pushed (PS apply and pull are not modelled), so
the simulated iteration time shows the effect of the order, roughly. Links
of ``--gbps`` each (one per PS task); variables are cut into each scheduler's
partition size and placed largest first on the least-loaded link.

Per repetition: a fresh scheduler runs ``--iters`` iterations (Prophet
profiles iterations 2-6 and plans from iteration 7). "all" amortises over every
iteration (profiling and plan building included), "planned" over iterations 8
onward. Median and range over ``--reps`` repetitions.

Run: python benchmarks/bench_scheduler.py [--reps 11] [--iters 20] [--gbps 3] [--ps 1]
"""

import argparse
import collections
import heapq
import math
import pathlib
import random
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from prophet_tf.engine import schedulers  # noqa: E402
from prophet_tf.engine.schedulers import ReadyItem  # noqa: E402

MS = 1_000_000


def resnet50():
    """(nbytes, block index, flops) per trainable variable, in forward order."""
    variables = []  # (nbytes, block)
    flops = collections.Counter()

    def conv(k, cin, cout, hw, block):
        variables.append((4 * k * k * cin * cout, block))
        flops[block] += k * k * cin * cout * hw * hw

    def bn(c, block):
        variables.extend([(4 * c, block), (4 * c, block)])

    conv(7, 3, 64, 112, 0)
    bn(64, 0)
    block, cin = 0, 64
    for blocks, width, hw in [(3, 64, 56), (4, 128, 28), (6, 256, 14), (3, 512, 7)]:
        for b in range(blocks):
            block += 1
            if b == 0:
                conv(1, cin, 4 * width, hw, block)
                bn(4 * width, block)
            conv(1, cin, width, hw, block)
            bn(width, block)
            conv(3, width, width, hw, block)
            bn(width, block)
            conv(1, width, 4 * width, hw, block)
            bn(4 * width, block)
            cin = 4 * width
    block += 1
    variables.extend([(4 * 2048 * 1000, block), (4 * 1000, block)])
    flops[block] += 2048 * 1000
    return variables, flops


def backward_trace(variables, flops, backward_ns, rng):
    """{key: ready ns since backprop start}: one burst per block, last block first."""
    total = sum(flops.values())
    t, ready_at = 0, {}
    for block in sorted(flops, reverse=True):
        t += backward_ns * flops[block] / total
        ready_at[block] = t
    return {k: int(ready_at[block]) + rng.randint(0, 50_000)
            for k, (_, block) in enumerate(variables)}


def partitions(variables, partition_bytes, num_ps):
    """{key: [(ps_index, nbytes)]}: equal cuts of at most partition_bytes, LPT placement."""
    pieces = []
    for k, (nbytes, _) in enumerate(variables):
        n = max(1, math.ceil(nbytes / partition_bytes))
        base, extra = divmod(nbytes, n)
        pieces += [(k, p, base + (p < extra)) for p in range(n)]
    loads = [(0, ps) for ps in range(num_ps)]
    parts = collections.defaultdict(dict)
    for k, p, nbytes in sorted(pieces, key=lambda x: (-x[2], x[0], x[1])):
        load, ps = heapq.heappop(loads)
        parts[k][p] = (ps, nbytes)
        heapq.heappush(loads, (load + nbytes, ps))
    return {k: [parts[k][p] for p in sorted(parts[k])] for k in parts}


def run(name, args, seed):
    """One repetition: (ns in scheduler calls per iteration, items/iteration,
    blocks/iteration, median iteration ns)."""
    rng = random.Random(seed)
    variables, flops = resnet50()
    sched = schedulers.make_scheduler(name)
    parts = partitions(variables, sched.partition_bytes or schedulers.DEFAULT_PARTITION_BYTES,
                       args.ps)
    backward_ns = int(args.backward_ms * MS)
    forward_ns = [backward_ns / 2 * n / sum(v[0] for v in variables) for n, _ in variables]
    bytes_per_ns = args.gbps / 8
    clock = time.perf_counter_ns
    spent = [0] * args.iters
    items_per_iter = sum(len(p) for p in parts.values())
    blocks = 0
    events, seq = [], 0
    busy, queues = set(), collections.defaultdict(collections.deque)
    left = {}  # (step, key) -> partitions not yet sent
    unsent = collections.Counter()  # step -> partitions not yet sent
    pushed_at = {}  # key -> when its gradient of the current step was fully sent
    starts = []

    def push(t, kind, payload):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    def start_link(link, now):
        block = queues[link].popleft()
        busy.add(link)
        nbytes = sum(i.nbytes for i in block)
        push(now + args.latency_us * 1000 + max(1, round(nbytes / bytes_per_ns)), "sent",
             (block, now))

    def begin(step, t0):
        starts.append(t0)
        for key, rel in backward_trace(variables, flops, backward_ns, rng).items():
            push(t0 + rel, "ready", (step, key))
            left[step, key] = len(parts[key])
            unsent[step] += len(parts[key])

    begin(0, 0)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "ready":
            step, key = payload
            t = clock()
            for p, (ps, nbytes) in enumerate(parts[key]):
                sched.add(ReadyItem(key, p, ps, step, key, nbytes, now))
            spent[step] += clock() - t
        else:
            block, started = payload
            step = block[0].iteration
            t = clock()
            sched.on_sent(block, started, now)
            spent[step] += clock() - t
            link = block[0].ps_index
            busy.discard(link)
            if queues[link]:
                start_link(link, now)
            unsent[step] -= len(block)
            for item in block:
                left[item.iteration, item.key] -= 1
                if left[item.iteration, item.key] == 0:
                    del left[item.iteration, item.key]
                    pushed_at[item.key] = now
            if unsent[step] == 0 and step + 1 < args.iters:
                f = 0
                for key, fwd in enumerate(forward_ns):  # forward waits for each parameter
                    f = max(f, pushed_at[key]) + fwd
                begin(step + 1, int(f))
        while True:
            t = clock()
            block = sched.next_block(now)
            spent[payload[0] if kind == "ready" else payload[0][0].step] += clock() - t
            if not block:
                break
            blocks += 1
            link = block[0].ps_index
            queues[link].append(block)
            if link not in busy:
                start_link(link, now)
    return spent, items_per_iter, blocks / args.iters, statistics.median(
        b - a for a, b in zip(starts, starts[1:]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--gbps", type=float, default=3.0, help="bandwidth of each link")
    parser.add_argument("--latency-us", type=float, default=100.0, help="per-transfer latency")
    parser.add_argument("--backward-ms", type=float, default=150.0)
    parser.add_argument("--ps", type=int, default=1, help="PS tasks (links)")
    args = parser.parse_args(argv)
    planned_from = schedulers.ProphetScheduler.WARMUP_ITERATIONS + \
        schedulers.ProphetScheduler.PROFILE_ITERATIONS + 1
    if args.iters <= planned_from:
        parser.error(f"--iters must exceed {planned_from}. Received: --iters={args.iters}")
    grads = len(resnet50()[0])
    print(f"ResNet-50-like: {grads} gradients/iteration, {args.iters} iterations x {args.reps} "
          f"reps, {args.ps} link(s) of {args.gbps:g} Gbit/s, backprop {args.backward_ms:g} ms")
    print(f"{'scheduler':<14}{'items/it':>9}{'blocks/it':>10}{'us/grad all':>13}"
          f"{'range':>15}{'us/grad planned':>17}{'range':>15}{'sim iter ms':>13}")
    for name in schedulers.SCHEDULERS:
        run(name, args, seed=0)  # warm up
        all_us, planned_us, iteration_ms = [], [], []
        for rep in range(args.reps):
            spent, items, blocks, iteration_ns = run(name, args, seed=rep)
            all_us.append(sum(spent) / (grads * args.iters) / 1000)
            planned_us.append(sum(spent[planned_from:]) /
                              (grads * (args.iters - planned_from)) / 1000)
            iteration_ms.append(iteration_ns / MS)
        print(f"{name:<14}{items:>9}{blocks:>10.1f}{statistics.median(all_us):>13.2f}"
              f"{f'{min(all_us):.2f}-{max(all_us):.2f}':>15}{statistics.median(planned_us):>17.2f}"
              f"{f'{min(planned_us):.2f}-{max(planned_us):.2f}':>15}"
              f"{statistics.median(iteration_ms):>13.1f}")


if __name__ == "__main__":
    main()
