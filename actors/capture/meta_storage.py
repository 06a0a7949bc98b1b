"""Distinct storage ids for meta tensors in an Execution Trace.

The ET observer names a tensor's storage by its data pointer, and torch's meta allocator
returns nullptr for every allocation: every meta tensor of a trace would share one storage
id, so liveness, parameters and views could not be told apart. While a meta capture runs,
:func:`unique_meta_storages` swaps in an allocator that hands out distinct, never-used
addresses (nothing reads meta data), so a meta trace names storages the way a real one does,
except that addresses are never reused (as if captured with unique storage ids).

The allocator is a few lines of C++ against c10 (``c10::SetAllocator``, which has no Python
binding), compiled once with the system C++ compiler (~1 s) into ``~/.cache/tracefleet``.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import torch

from actors.errors import ConfigError

COMPILE_TIMEOUT_S = 120
_CACHE = Path(os.environ.get("TRACEFLEET_CACHE_DIR", "~/.cache/tracefleet")).expanduser()
_SOURCE = r"""
#include <c10/core/Allocator.h>
#include <atomic>
#include <cstdint>

namespace {
struct UniqueMetaAllocator final : c10::Allocator {
  // Far above any real heap address; 64-byte steps keep distinct allocations distinct.
  std::atomic<std::uintptr_t> next{std::uintptr_t{1} << 46};
  static void deleter(void*) {}
  c10::DataPtr allocate(size_t nbytes) override {
    void* p = reinterpret_cast<void*>(next.fetch_add((nbytes + 63) / 64 * 64 + 64));
    return {p, nullptr, &deleter, c10::Device(c10::DeviceType::Meta)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return deleter; }
  void copy_data(void*, const void*, std::size_t) const override {}
};
UniqueMetaAllocator g_unique;
c10::Allocator* g_default = nullptr;
constexpr uint8_t kPriority = 100;  // above the built-in registration's 0
}  // namespace

extern "C" int tracefleet_unique_meta_install() {
  if (g_default == nullptr) g_default = c10::GetAllocator(c10::DeviceType::Meta);
  c10::SetAllocator(c10::DeviceType::Meta, &g_unique, kPriority);
  return c10::GetAllocator(c10::DeviceType::Meta) == &g_unique;
}

extern "C" int tracefleet_unique_meta_uninstall() {
  if (g_default != nullptr) c10::SetAllocator(c10::DeviceType::Meta, g_default, kPriority);
  return c10::GetAllocator(c10::DeviceType::Meta) == g_default;
}
"""
_lib: ctypes.CDLL | None = None


def _build() -> ctypes.CDLL:
    """Compile (once per torch build) and load the allocator library."""
    global _lib
    if _lib is not None:
        return _lib
    torch_dir = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    key = hashlib.sha256(f"{_SOURCE}{torch.__version__}{torch_dir}{abi}".encode()).hexdigest()[:16]
    lib_path = _CACHE / "meta_storage" / f"unique_meta_{key}.so"
    if not lib_path.is_file():
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            raise ConfigError("workload.device=meta needs a C++ compiler (c++, g++ or $CXX) to "
                              "build its meta allocator once; none found on PATH")
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        src = lib_path.with_suffix(".cpp")
        src.write_text(_SOURCE)
        partial = lib_path.with_name(f"{lib_path.name}.{os.getpid()}.partial")
        cmd = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-I{torch_dir / 'include'}", str(src), f"-L{torch_dir / 'lib'}", "-lc10",
               f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(partial)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"building the meta allocator with {compiler} took over "
                              f"{COMPILE_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            raise ConfigError(f"building the meta allocator with {compiler} failed: "
                              f"{proc.stderr.strip()[-500:]}")
        os.replace(partial, lib_path)  # atomic: concurrent builders never load a partial file
    _lib = ctypes.CDLL(str(lib_path))
    return _lib


@contextmanager
def unique_meta_storages():
    """Within the block, every new meta tensor gets its own data pointer (see module doc)."""
    lib = _build()
    if not lib.tracefleet_unique_meta_install():
        raise ConfigError("could not install the unique meta allocator (c10::SetAllocator)")
    try:
        yield
    finally:
        lib.tracefleet_unique_meta_uninstall()
