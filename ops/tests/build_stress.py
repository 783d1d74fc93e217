"""Builds (and optionally runs) the native stress test of the op runtime.

    python ops/tests/build_stress.py --mode plain|asan|tsan [--run SECONDS]
                                     [--threads N] [--seed N]

The binary links ops/runtime.cc directly (not _prophet_ops.so) against
TensorFlow's libtensorflow_framework.so.2, with the compile and link flags of
the installed TensorFlow, taken the way setup.py's compile_ops takes them.
Output: build/stress/runtime_stress-<mode>. A build is skipped when the binary
is newer than its sources and was made by the same command.

With --run, the binary runs with the sanitizer options of run_env (TSan
suppressions: tsan.supp here) and this script exits with its exit code.
"""
import argparse
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OPS_DIR = ROOT / "ops"
OUT_DIR = ROOT / "build" / "stress"
SOURCES = [OPS_DIR / "runtime.cc", HERE / "runtime_stress.cc"]
HEADERS = [OPS_DIR / "runtime.h"]

MODES = {
    "plain": ["-O2", "-g"],
    # GCC 12 cannot constant-evaluate absl's `function pointer == nullptr`
    # (hash_policy_traits.h) under the null, nonnull-attribute and
    # returns-nonnull-attribute checks, so those three are left out; a null
    # dereference still stops the run as an ASan SEGV report.
    "asan": ["-fsanitize=address,undefined", "-fno-sanitize=null,nonnull-attribute,returns-nonnull-attribute",
             "-fno-omit-frame-pointer", "-g", "-O1"],
    "tsan": ["-fsanitize=thread", "-g", "-O1"],
}
# Debian ships the sanitizer runtimes in packages named after the soname
# (gcc 12: libasan8, libubsan1, libtsan2); `apt-get install g++` pulls them in.
SANITIZER_PACKAGES = {"asan": "libasan8 libubsan1", "tsan": "libtsan2"}


class BuildError(RuntimeError):
    pass


class SanitizerMissing(BuildError):
    pass


def compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise BuildError(f"C++ compiler {cxx!r} not found (set CXX, or `apt-get install g++`)")
    return cxx


def tf_flags():
    """Compile and link flags exactly as setup.py's compile_ops uses them."""
    import tensorflow as tf

    # TensorFlow's headers as system headers, so -Wall reports on ours only.
    compile_flags = ["-isystem" + f[2:] if f.startswith("-I") else f
                     for f in tf.sysconfig.get_compile_flags()]
    link_flags = list(tf.sysconfig.get_link_flags())
    # The binary is run from the build tree: find libtensorflow_framework.so.2
    # where it was linked from.
    rpaths = [f"-Wl,-rpath,{f[2:]}" for f in link_flags if f.startswith("-L")]
    return compile_flags, link_flags + rpaths


def check_sanitizer(cxx: str, mode: str) -> None:
    """Compiles and runs a tiny program with the mode's flags."""
    if mode == "plain":
        return
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "probe.cc"
        exe = pathlib.Path(tmp) / "probe"
        src.write_text("#include <thread>\nint main() { std::thread t([] {}); t.join(); return 0; }\n")
        cmd = [cxx, *MODES[mode], str(src), "-o", str(exe), "-pthread"]
        build = subprocess.run(cmd, capture_output=True, text=True)
        run = subprocess.run([str(exe)], capture_output=True, text=True) if build.returncode == 0 else None
        if build.returncode != 0 or run.returncode != 0:
            detail = (build.stderr if build.returncode != 0 else run.stderr).strip()
            raise SanitizerMissing(
                f"{cxx} cannot build or run a {mode} program; the sanitizer runtime is probably missing "
                f"(Debian: `apt-get install {SANITIZER_PACKAGES[mode]}`).\n"
                f"command: {shlex.join(cmd)}\n{detail}")


def output_path(mode: str) -> pathlib.Path:
    return OUT_DIR / f"runtime_stress-{mode}"


def build(mode: str, force: bool = False) -> pathlib.Path:
    if mode not in MODES:
        raise BuildError(f"mode must be one of {', '.join(MODES)}. Received: {mode!r}")
    cxx = compiler()
    check_sanitizer(cxx, mode)
    compile_flags, link_flags = tf_flags()
    out = output_path(mode)
    out.parent.mkdir(parents=True, exist_ok=True)
    def command(target):
        return [cxx, *MODES[mode], "-Wall", "-pthread", f"-I{OPS_DIR}",
                *compile_flags, *map(str, SOURCES), "-o", str(target), *link_flags]

    import tensorflow as tf

    print(shlex.join(command(out)), flush=True)
    key = f"tensorflow {tf.__version__}: {shlex.join(command(out))}"
    stamp = out.with_name(out.name + ".cmd")
    if (not force and out.exists() and stamp.exists() and stamp.read_text() == key
            and all(out.stat().st_mtime > p.stat().st_mtime for p in SOURCES + HEADERS)):
        print(f"{out} is up to date", flush=True)
        out.touch()  # make's rule then sees it newer than its inputs, and skips this check
        return out
    # Built aside and renamed, so a concurrent build or run never sees half a binary.
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    try:
        subprocess.check_call(command(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    stamp.write_text(key)
    return out


def run_env(mode: str) -> dict:
    """Environment for a run: sanitizer options, unless the caller set them."""
    env = dict(os.environ)
    if mode != "plain":
        # Without oneDNN, TensorFlow's CPU allocator mallocs each tensor buffer
        # on its own, so the sanitizers see every buffer's bounds and lifetime
        # (oneDNN's allocator sub-allocates buffers >= 4 KiB from arenas).
        env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    if mode == "asan":
        # Leak checking stays on: the run ends with a reset, so anything the
        # runtime or a callback still owns at exit is a leak.
        env.setdefault("ASAN_OPTIONS", "halt_on_error=1:detect_leaks=1:abort_on_error=0")
        env.setdefault("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
    elif mode == "tsan":
        # The largest access history (4M accesses per thread, not 128K): a report whose
        # earlier access was forgotten has no stack for tsan.supp to match, and says
        # only "failed to restore the stack".
        env.setdefault("TSAN_OPTIONS", f"suppressions={HERE / 'tsan.supp'}:halt_on_error=1:"
                                       "second_deadlock_stack=1:print_suppressions=0:"
                                       "history_size=7")
    return env


def run(mode: str, seconds: float, threads: int = 8, seed=None, capture: bool = False):
    """Builds `mode` and runs it; returns the CompletedProcess."""
    exe = build(mode)
    cmd = [str(exe), "--seconds", str(seconds), "--threads", str(threads)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    env = run_env(mode)
    shown = {k: env[k] for k in ("TF_ENABLE_ONEDNN_OPTS", "ASAN_OPTIONS", "UBSAN_OPTIONS", "TSAN_OPTIONS") if k in env}
    print(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in shown.items()), shlex.join(cmd)]), flush=True)
    return subprocess.run(cmd, env=env, text=True, capture_output=capture)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="plain")
    parser.add_argument("--run", type=float, metavar="SECONDS", help="run the binary this long after building")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # quiet `import tensorflow`
    try:
        if args.run is None:
            build(args.mode, force=args.force)
            return 0
        if args.force:
            build(args.mode, force=True)
        return run(args.mode, args.run, args.threads, args.seed).returncode
    except BuildError as e:
        print(f"build_stress: error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"build_stress: error: compiler failed with exit code {e.returncode}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
