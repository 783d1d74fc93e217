"""Build steps that pyproject.toml cannot express.

1. Generate the Python gRPC modules from protos/prophet_tf/ps/v1/*.proto with
   grpcio-tools (imports read ``prophet_tf.ps.v1.ps_pb2``).
2. Compile ops/**/*.cc into prophet_tf/_prophet_ops.so with the compile and
   link flags of the installed TensorFlow (tf.sysconfig only), and record the
   TensorFlow version it was built against in prophet_tf/_build_info.json so a
   later load failure can name both versions.

Both write into the source tree, so ``pip install -e .`` and
``python setup.py build_ext --inplace`` leave a working checkout.

3. Compile native/max_min.c (plain C, no TensorFlow) into
   prophet_tf/_max_min.so: the simulator's max-min fair rates, loaded with ctypes;
   and native/fluid_core.c with it into prophet_tf/_fluid_core.abi3.so, the
   simulator's compiled event queue and network, a CPython extension built
   against Python 3.11's stable ABI.
4. Tag the wheel ``cp311-abi3-<platform>``: the op library links TensorFlow's
   ``libtensorflow_framework.so.2``, not libpython, the simulator's libraries
   libc, libm and Python's stable ABI, and the rest is pure Python, so any
   CPython from 3.11 that the TensorFlow it was built against supports can
   load them (the TensorFlow minor version is checked at load time).
"""
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"
OPS_DIR = ROOT / "ops"
PACKAGE = ROOT / "prophet_tf"
OPS_LIBRARY = "_prophet_ops.so"
MAX_MIN_SOURCE = ROOT / "native" / "max_min.c"
MAX_MIN_LIBRARY = "_max_min.so"
FLUID_CORE_SOURCE = ROOT / "native" / "fluid_core.c"
FLUID_CORE_LIBRARY = "_fluid_core.abi3.so"
NATIVE_LIBRARIES = (OPS_LIBRARY, MAX_MIN_LIBRARY, FLUID_CORE_LIBRARY)


def generate_grpc_code():
    """Generates *_pb2.py, *_pb2_grpc.py and *.pyi next to the package."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
            f"--python_out={ROOT}", f"--grpc_python_out={ROOT}", f"--pyi_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {protos}")


def compile_ops(output: pathlib.Path):
    """Compiles every ops/**/*.cc into one shared library."""
    import tensorflow as tf

    # ops/tests/ holds standalone programs (the runtime stress test), not the library.
    sources = sorted(str(p) for p in OPS_DIR.rglob("*.cc")
                     if p.relative_to(OPS_DIR).parts[0] != "tests")
    if not sources:
        raise RuntimeError(f"no C++ sources under {OPS_DIR}")
    cxx = os.environ.get("CXX", "g++")
    # TensorFlow's headers are included as system headers so that -Wall
    # reports on our sources, not on theirs.
    tf_flags = ["-isystem" + f[2:] if f.startswith("-I") else f
                for f in tf.sysconfig.get_compile_flags()]
    compile_flags = ["-fPIC", "-O2", "-Wall", f"-I{OPS_DIR}", *tf_flags]
    # One compiler per source, as many at once as there are cores (TensorFlow's
    # headers make each a long compile), then one link.
    jobs = max(1, min(len(sources), int(os.environ.get("PROPHET_TF_BUILD_JOBS", 0))
                      or os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="prophet_tf-ops-") as objects:
        commands = [[cxx, "-c", *compile_flags, source, "-o",
                     os.path.join(objects, f"{i}-{pathlib.Path(source).stem}.o")]
                    for i, source in enumerate(sources)]

        def run(cmd):
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd)

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            list(pool.map(run, commands))  # re-raises the first failed compile
        run([cxx, "-shared", *[c[-1] for c in commands], "-o", str(output),
             *tf.sysconfig.get_link_flags()])
    info = {"tensorflow_version": tf.__version__, "cxx11_abi": tf.sysconfig.CXX11_ABI_FLAG,
            "compiler": cxx}
    (output.parent / "_build_info.json").write_text(json.dumps(info, indent=2) + "\n")


def compile_max_min(output: pathlib.Path):
    """Compiles the simulator's max-min filling into a plain C shared library.
    Warnings are errors only in the tests' sanitizer build (test_max_min_native.py):
    a user's newer compiler may warn where this one does not."""
    cc = os.environ.get("CC", "gcc")
    cmd = [cc, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", str(MAX_MIN_SOURCE),
           "-o", str(output), "-lm"]
    print(" ".join(cmd), flush=True)
    subprocess.check_call(cmd)


def compile_fluid_core(output: pathlib.Path):
    """Compiles the simulator's event queue and network, with the max-min
    filling it calls, into a CPython extension (stable ABI). No fused
    multiply-adds: its float operations are the Python path's, to the bit."""
    import sysconfig
    include = pathlib.Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        # Only the simulator needs it, and it has a Python path with the same
        # results: the rest of the package must still install.
        print(f"WARNING: not building the simulator's compiled core: Python's headers "
              f"are not in {include} (Debian and Ubuntu: apt install python3-dev). "
              f"`prophet-tf simulate` runs its Python path, with the same results, slower.",
              flush=True)
        output.unlink(missing_ok=True)
        return
    cc = os.environ.get("CC", "gcc")
    cmd = [cc, "-shared", "-fPIC", "-O2", "-ffp-contract=off", "-Wall", "-Wextra",
           f"-I{include}", str(FLUID_CORE_SOURCE), str(MAX_MIN_SOURCE), "-o", str(output),
           "-lm"]
    print(" ".join(cmd), flush=True)
    subprocess.check_call(cmd)


class BuildPy(build_py):
    def run(self):
        generate_grpc_code()
        super().run()


class BuildOps(build_ext):
    """Builds the op library with TensorFlow's flags instead of distutils'."""

    def run(self):
        generate_grpc_code()
        target = PACKAGE / OPS_LIBRARY
        compile_ops(target)
        compile_max_min(PACKAGE / MAX_MIN_LIBRARY)
        compile_fluid_core(PACKAGE / FLUID_CORE_LIBRARY)
        if not self.inplace:
            # A regular (non-editable) build: ship the libraries in the wheel.
            dest = pathlib.Path(self.build_lib) / "prophet_tf"
            dest.mkdir(parents=True, exist_ok=True)
            for name in (*NATIVE_LIBRARIES, "_build_info.json"):
                if (PACKAGE / name).is_file():  # the compiled core may be left out
                    self.copy_file(str(PACKAGE / name), str(dest / name))

    def get_outputs(self):
        # As run() copies them: the compiled core may have been left out.
        return [os.path.join(self.build_lib, "prophet_tf", name)
                for name in NATIVE_LIBRARIES if (PACKAGE / name).is_file()]


class BdistWheel(bdist_wheel):
    """Platform-specific (the native libraries), on Python's stable ABI from 3.11."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "cp311", "abi3", platform


setup(
    # A placeholder extension makes setuptools run build_ext and mark the
    # wheel as platform-specific; BuildOps does the real work.
    ext_modules=[Extension("prophet_tf._prophet_ops", sources=[])],
    cmdclass={"build_py": BuildPy, "build_ext": BuildOps, "bdist_wheel": BdistWheel},
)
