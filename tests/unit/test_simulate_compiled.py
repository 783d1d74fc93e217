"""The compiled network (native/fluid_core.c) gives the Python rate-lag path's
results to the last bit, refuses bad input naming it and changing nothing, and
is freed with its callbacks (its events' order: test_simulate_events.py)."""
from __future__ import annotations

import gc
import math
import random
import subprocess
import sys
import weakref

import pytest

from simulate_helpers import TOY
from prophet_tf.bench import saved_profiles, simulate
from prophet_tf.bench.simulate_compiled import CompiledFluidSim
from prophet_tf.bench.simulate_network import FluidSim, fluid_sim
from prophet_tf.engine import schedulers

NAMES = list(schedulers.SCHEDULERS)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", NAMES)
def test_simulations_are_the_python_paths_to_the_bit(name):
    """Whole simulations, every field of the result: layouts, uneven shares
    (weights drawn in the same order), latency, per-byte costs, lags."""
    cases = [dict(workers=3, num_ps=3, bandwidth_mbit=100, layout="colocated"),
             dict(workers=4, num_ps=8, bandwidth_mbit=300, layout="colocated", latency_ms=0.5,
                  share_sigma=0.5, seed=3),
             dict(workers=4, num_ps=2, bandwidth_mbit=200, layout="dedicated",
                  rpc_per_byte_s=2e-9, rate_lag_s=1e-3),
             dict(workers=2, num_ps=4, bandwidth_mbit=50, layout="colocated",
                  answers_first=False, rate_lag_s=5e-5)]
    for case in cases:
        python = simulate.simulate(TOY, name, compiled=False, **case)
        assert simulate.simulate(TOY, name, **case) == python, case
    resnet = dict(workers=6, num_ps=6, bandwidth_mbit=2000, layout="colocated",
                  compute_s=0.25, iterations=4, warmup=2)
    profile = saved_profiles.load_profile("resnet50")
    assert (simulate.simulate(profile, name, **resnet)
            == simulate.simulate(profile, name, compiled=False, **resnet))


@pytest.mark.timeout(60)
def test_a_rate_lag_is_compiled_unless_asked_not_to():
    assert type(fluid_sim({"a": 1.0}, rate_lag_s=0.1)) is CompiledFluidSim
    assert type(fluid_sim({"a": 1.0}, rate_lag_s=0.1, compiled=False)) is FluidSim
    assert type(fluid_sim({"a": 1.0})) is FluidSim  # no lag: the Python classes' path


# An install without Python's headers has no compiled core: import it as absent.
_WITHOUT_CORE = """
import logging, sys
sys.modules["prophet_tf._fluid_core"] = None
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from prophet_tf.bench import simulate_network
for _ in range(3):
    sim = simulate_network.fluid_sim({"a": 1.0}, rate_lag_s=0.1)
print(type(sim).__name__)
"""


@pytest.mark.timeout(60)
def test_without_the_compiled_core_the_python_path_runs_with_one_warning():
    run = subprocess.run([sys.executable, "-c", _WITHOUT_CORE], capture_output=True,
                         text=True, timeout=50)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "FluidSim"
    warnings = [line for line in run.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "compiled simulator core was not built" in warnings[0]
    assert "the same results, slower" in warnings[0]


def _flows_as_lagged(sim_type):
    """A scripted run (the one of test_simulate's rate-lag test): when each
    flow ends, and each link's load after every start and end."""
    sim = sim_type({"a": 100.0, "b": 100.0, "free": math.inf}, rate_lag_s=0.5)
    ended, loads = {}, []

    def record():
        load = {}
        for f in sim.flows:  # the compiled flows name only the links that limit them
            for link in set(f.links) - {"free"}:
                load[link] = load.get(link, 0.0) + f.rate
        loads.append(load)

    def start(name, nbytes, links):
        sim.start_flow(nbytes, links, lambda: (ended.setdefault(name, sim.now), record()))
        record()
    sim.at(0.0, lambda: start("x", 100.0, ("a", "free")))
    sim.at(0.1, lambda: start("y", 100.0, ("a",)))
    sim.at(0.2, lambda: start("z", 10.0, ("b",)))
    sim.at(3.0, lambda: (start("p", 10.0, ("a",)), start("q", 100.0, ("a", "b"))))
    sim.at(3.3, lambda: start("r", 20.0, ("a",)))
    sim.at(3.4, lambda: start("empty", 0.0, ("a",)))
    sim.at(3.4, lambda: start("unlimited", 5.0, ("free",)))
    sim.run(until=lambda: len(ended) == 8)
    return ended, loads


@pytest.mark.timeout(60)
def test_flows_end_and_share_as_in_python():
    compiled = _flows_as_lagged(CompiledFluidSim)
    assert compiled == _flows_as_lagged(FluidSim)
    ended, loads = compiled
    assert ended["x"] == 1.5 and ended["y"] == 2.0 and ended["empty"] == 3.4
    assert all(rate <= 100.0 for load in loads for rate in load.values())


@pytest.mark.timeout(60)
def test_refill_gives_the_python_paths_rates_to_the_bit():
    rng = random.Random(4)
    capacity = {("w", h, d): rng.choice([100.0, 250.0]) for h in range(6) for d in ("up", "down")}
    paths = [(("w", s, "up"), ("w", r, "down")) for s in range(6) for r in range(6)
             if s != r and rng.random() < 0.7] + [(("w", 0, "up"),)]
    rates = []
    for sim_type in (FluidSim, CompiledFluidSim):
        sim = sim_type(capacity, share_sigma=0.5, seed=1, rate_lag_s=1.0)
        for path in paths * 2:
            sim.start_flow(1e6, path, lambda: None)
        sim._refill()
        rates.append([(f.links, f.rate) for f in sim.flows])
    assert rates[0] == rates[1]


@pytest.mark.timeout(60)
def test_bad_input_is_refused_naming_it_and_changes_nothing():
    with pytest.raises(ValueError, match="rate_lag_s=0.0"):
        CompiledFluidSim({"a": 1.0}, rate_lag_s=0.0)
    sim = CompiledFluidSim({"a": 1.0, "b": 1.0, "c": 1.0}, rate_lag_s=0.1)
    ran = []
    with pytest.raises(ValueError, match="in order of time. Received at 1"):
        sim.at_sorted([(1.0, lambda: ran.append(1)), (0.5, lambda: ran.append(2))])
    with pytest.raises(TypeError, match="callable. Received: 3"):
        sim.at(1.0, 3)
    with pytest.raises(ValueError, match="at most two links"):
        sim.start_flow(1.0, ("a", "b", "c"), lambda: None)
    with pytest.raises(ValueError, match=r"link ids in \[1, 1\)"):
        sim._start(1.0, 5, 0, 1.0, lambda: None)
    with pytest.raises(TypeError, match="Received: 'soon'"):
        sim.run(until="soon")
    with pytest.raises(RuntimeError, match="runs once"):
        sim.__init__(0.1)
    sim.run(until=lambda: False)
    assert ran == [] and sim.flows == [] and sim.now == 0.0  # nothing was queued


@pytest.mark.timeout(60)
def test_a_callbacks_error_stops_the_run_and_reaches_the_caller():
    sim = CompiledFluidSim({"a": 10.0}, rate_lag_s=0.1)
    sim.at(0.0, lambda: sim.start_flow(10.0, ("a",), lambda: 1 / 0))
    with pytest.raises(ZeroDivisionError):
        sim.run(until=lambda: False)
    assert sim.now == 1.0


@pytest.mark.timeout(60)
def test_a_simulator_and_its_callbacks_are_freed():
    """The callbacks hold the simulator (as the workers' do): the collector
    frees the cycle, with flows and events still queued."""
    sim = CompiledFluidSim({"a": 10.0}, rate_lag_s=0.1)
    sim.at(5.0, lambda: sim)
    sim.at(0.0, lambda: sim.start_flow(1e9, ("a",), lambda: sim))
    sim.run(until=lambda: bool(sim.flows))
    alive = weakref.ref(sim)
    del sim
    gc.collect()
    assert alive() is None
