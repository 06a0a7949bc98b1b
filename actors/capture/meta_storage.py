"""Distinct storage ids for meta tensors in an Execution Trace.

The ET observer names a tensor's storage by its data pointer, and torch's meta allocator
returns nullptr for every allocation: every meta tensor of a trace would share one storage
id, so liveness, parameters and views could not be told apart. While a meta capture runs,
:func:`unique_meta_storages` swaps in an allocator that hands out distinct, never-used
addresses (nothing reads meta data), so a meta trace names storages the way a real one does,
except that addresses are never reused (as if captured with unique storage ids).

The allocator is a few lines of C++ against c10 (``c10::SetAllocator``, which has no Python
binding), compiled once with the system C++ compiler (~1 s) by :mod:`actors.native`.
"""
from __future__ import annotations

from contextlib import contextmanager

from actors.errors import ConfigError
from actors.native import load_library

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
@contextmanager
def unique_meta_storages():
    """Within the block, every new meta tensor gets its own data pointer (see module doc)."""
    lib = load_library("unique_meta", _SOURCE, "workload.device=meta (its meta allocator)")
    if not lib.tracefleet_unique_meta_install():
        raise ConfigError("could not install the unique meta allocator (c10::SetAllocator)")
    try:
        yield
    finally:
        lib.tracefleet_unique_meta_uninstall()
