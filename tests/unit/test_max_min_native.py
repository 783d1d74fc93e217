"""The simulator's native code under AddressSanitizer and UBSan: the max-min
filling (native/max_min.c) on native/tests/max_min_check.c's random cases, and
the compiled network (native/fluid_core.c) loaded into Python for whole
simulations. test_simulate_events.py checks the rates against numpy's,
test_simulate_compiled.py the network against the Python path."""
import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_max_min_passes_its_checks_under_sanitizers(tmp_path):
    binary = tmp_path / "max_min_check"
    cc = os.environ.get("CC", "gcc")
    subprocess.run([cc, "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer", "-g", "-O1", "-Wall", "-Wextra", "-Werror",
                    str(ROOT / "native" / "max_min.c"),
                    str(ROOT / "native" / "tests" / "max_min_check.c"), "-o", str(binary), "-lm"],
                   check=True, timeout=100)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=100, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip() == "2000 cases passed"


# Loads the sanitized build as prophet_tf._fluid_core, then simulates with it
# and with the Python path: uneven shares, all of the core's paths.
_SIMULATE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("prophet_tf._fluid_core", sys.argv[1])
core = importlib.util.module_from_spec(spec)
spec.loader.exec_module(core)
sys.modules["prophet_tf._fluid_core"] = core
from prophet_tf.bench import saved_profiles, simulate, simulate_compiled
assert simulate_compiled.Core is core.Core
profile = saved_profiles.load_profile("resnet50")
case = dict(workers=6, num_ps=6, bandwidth_mbit=2000, layout="colocated", compute_s=0.25,
            iterations=4, warmup=2, share_sigma=0.3)
for name in ("fifo", "prophet"):
    assert (simulate.simulate(profile, name, **case)
            == simulate.simulate(profile, name, compiled=False, **case)), name
print("same results")
"""


@pytest.mark.timeout(180)
def test_fluid_core_simulates_under_sanitizers(tmp_path):
    library = tmp_path / "_fluid_core.abi3.so"
    cc = os.environ.get("CC", "gcc")
    subprocess.run([cc, "-shared", "-fPIC", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1",
                    "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
                    f"-I{sysconfig.get_paths()['include']}", str(ROOT / "native" / "fluid_core.c"),
                    str(ROOT / "native" / "max_min.c"), "-o", str(library), "-lm"],
                   check=True, timeout=100)
    # Python is not instrumented: the runtime is loaded first. Python's own
    # allocations live to exit, so leaks are not checked here.
    asan = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True,
                          check=True).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", _SIMULATE, str(library)], capture_output=True,
                         text=True, timeout=150, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip() == "same results"
