"""Our C kernels (enginecore/csrc), built on first use by this machine's C compiler for this machine's CPU.

Why at run time: `-march=native` lets the compiler use what this CPU has (AVX2 and FMA, AVX-512, NEON), which
a wheel built once for every CPU could not, and the kernels are small (a C file builds in about a second). The
library is kept under the cache directory ($XDG_CACHE_HOME/supervise/native) by a hash of everything that
makes it (the source, the compiler and its version, the flags, the CPU's model and flags), so a later start
loads it at once, and a home directory shared between unlike machines keeps one per CPU. No compiler, or one
that fails, leaves the kernel unavailable with the reason: the caller falls back to torch's kernels.

OpenMP: the library links libgomp by its soname, and torch's CPU wheels carry a libgomp of the same soname that
the process has loaded before, so the kernels run on torch's own OpenMP threads (its count, its spin waits).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3"])  # the first that builds


class NativeUnavailable(RuntimeError):
    """A kernel library that could not be built or loaded here; the message says why."""


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_identity() -> str:
    """What the CPU is, as far as code built with -march=native cares: its model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    """The cache's native/ directory, or one under the temporary directory where that cannot be used. Either must
    be ours and writable by no one else: a library found there is loaded and run, and a name under /tmp can be
    made first by any user (who could leave a library of their own under the name we would look for)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for where in (Path(base) / "supervise" / "native", Path(tempfile.gettempdir()) / f"supervise-native-{os.getuid()}"):
        try:
            where.mkdir(mode=0o700, parents=True, exist_ok=True)
            if _only_ours(where):
                return where
            log.warning("not building native kernels in %s: it is not ours alone (owner or permissions)", where)
        except OSError:
            continue
    raise NativeUnavailable(f"no directory of ours alone to build it in ({base}/supervise/native nor the "
                            f"temporary one)")


def _only_ours(directory: Path) -> bool:
    """Owned by this user, writable by no one else, and not a link to somewhere else."""
    info = os.lstat(directory)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


def _build(cc: str, source: Path, flags: list[str], target: Path) -> str | None:
    """Compile `source` into the shared library `target`; None, or the compiler's complaint."""
    try:
        fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
        os.close(fd)
    except OSError as exc:
        return str(exc)
    try:
        done = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", partial, str(source)], capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        if done.returncode != 0:  # the first error, which says what (the last line is often "compilation terminated")
            lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
            return next((line for line in lines if "error" in line), lines[-1])
        os.replace(partial, target)  # whole or not at all, also when two engines build at once
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def library(name: str) -> ctypes.CDLL:
    """csrc/<name>.c built for this CPU and loaded, once per process; NativeUnavailable says why not."""
    lib, why = _loaded(name)
    if lib is None:
        raise NativeUnavailable(why)
    return lib


@functools.cache
def _loaded(name: str) -> tuple[ctypes.CDLL | None, str]:
    try:
        return _build_and_load(name), ""
    except NativeUnavailable as exc:
        return None, str(exc)


def _build_and_load(name: str) -> ctypes.CDLL:
    cc = compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler (cc, gcc or clang; or $CC) to build it with")
    source = SOURCES / f"{name}.c"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"the C compiler {cc} does not run: {exc}") from exc
    # what the source may include: a header, or another kernel's source (decode_layers.c includes three)
    headers = [f.read_text() for f in sorted(SOURCES.iterdir()) if f != source and f.suffix in (".c", ".h")]
    complaint = ""
    for flags in FLAG_SETS:
        key = hashlib.sha256("\0".join([source.read_text(), *headers, cc, version, *flags, _cpu_identity(),
                                        platform.machine()]).encode()).hexdigest()[:16]
        target = _cache_dir() / f"{name}-{key}.so"
        if not target.exists():
            started = time.monotonic()
            complaint = _build(cc, source, flags, target) or ""
            if complaint:
                continue
            log.log(logging.INFO if "-fopenmp" in flags else logging.WARNING, "built %s for this CPU in %.1f s: %s "
                    "%s%s (kept in %s)", source.name, time.monotonic() - started, cc, " ".join(flags),
                    "" if "-fopenmp" in flags else " (no OpenMP: one thread)", target.parent)
        try:
            return ctypes.CDLL(str(target))
        except OSError as exc:
            complaint = str(exc)
    raise NativeUnavailable(f"{cc} could not build {source.name}: {complaint}")
