"""Small C++ libraries against c10, compiled once with the system C++ compiler and loaded with
ctypes.

Some allocator hooks (``c10::SetAllocator``) have no Python binding. The project's few lines
of C++ for them are built here (~1-2 s each, once per source and torch build) into
``~/.cache/tracefleet/native`` (``$TRACEFLEET_CACHE_DIR`` overrides the root), keyed by a hash
of the source, torch's version, install path and C++ ABI, so a new torch rebuilds them.
Used by the capture side (meta storages) and by both sides' CPU memory counter.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from actors.errors import ConfigError

COMPILE_TIMEOUT_S = 120
_LOADED: dict[str, ctypes.CDLL] = {}
_LOCK = threading.Lock()  # one build per library even if two threads ask at once


def cache_dir() -> Path:
    """Root of the project's build cache."""
    return Path(os.environ.get("TRACEFLEET_CACHE_DIR", "~/.cache/tracefleet")).expanduser()


def load_library(name: str, source: str, purpose: str) -> ctypes.CDLL:
    """The library ``name`` built from C++ ``source`` (compiled on first use, then cached on
    disk and in this process). ``purpose`` names what needs it, for the errors: a
    :class:`ConfigError` without a compiler, on a failed build, or past the compile timeout."""
    with _LOCK:
        if name not in _LOADED:
            _LOADED[name] = ctypes.CDLL(str(_build(name, source, purpose)))
        return _LOADED[name]


def _build(name: str, source: str, purpose: str) -> Path:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    key = hashlib.sha256(f"{source}{torch.__version__}{torch_dir}{abi}".encode()).hexdigest()[:16]
    lib_path = cache_dir() / "native" / f"{name}_{key}.so"
    if lib_path.is_file():
        return lib_path
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise ConfigError(f"{purpose} needs a C++ compiler (c++, g++ or $CXX) to build "
                          f"{name} once; none found on PATH")
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    # per-process names: concurrent builders (ranks starting together) never share a file
    src = lib_path.with_name(f"{lib_path.stem}.{os.getpid()}.cpp")
    src.write_text(source)
    partial = lib_path.with_name(f"{lib_path.name}.{os.getpid()}.partial")
    cmd = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           f"-I{torch_dir / 'include'}", str(src), f"-L{torch_dir / 'lib'}", "-lc10",
           f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(partial)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"{purpose}: building {name} with {compiler} took over "
                          f"{COMPILE_TIMEOUT_S} s") from None
    finally:
        src.unlink(missing_ok=True)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"{purpose}: building {name} with {compiler} failed: "
                          f"{proc.stderr.strip()[-500:]}")
    os.replace(partial, lib_path)  # atomic: concurrent builders never load a partial file
    return lib_path
