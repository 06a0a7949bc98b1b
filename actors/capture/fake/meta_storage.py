"""Distinct storage ids for meta tensors in an Execution Trace.

The ET observer names a tensor's storage by its data pointer, and torch's meta allocator
returns nullptr for every allocation: every meta tensor of a trace would share one storage
id, so liveness, parameters and views could not be told apart. While a meta capture runs,
:func:`unique_meta_storages` swaps in an allocator that hands out distinct, never-used
addresses (nothing reads meta data), so a meta trace names storages the way a real one does,
except that addresses are never reused (as if captured with unique storage ids).

The allocator also knows when a storage dies: while :func:`record_frees` is on, its deleter
keeps the freed addresses, and :func:`take_freed` hands them over (the fake capture writes
them into the trace, actors/capture/fake/free_markers.py): the run's own frees, including tensors
the user's code holds past their last use (a ``ModelOutput`` keeping the logits alive through
backward), which no op in the trace shows.

The allocator is a few lines of C++ against c10 (``c10::SetAllocator``, which has no Python
binding), compiled once with the system C++ compiler (~1 s) by :mod:`actors.native`.
"""
from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager

from actors.errors import ConfigError
from actors.native import load_library

_SOURCE = r"""
#include <c10/core/Allocator.h>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

namespace {
std::atomic<bool> g_recording{false};
std::atomic<bool> g_paused{false};
std::mutex g_freed_mutex;
std::vector<std::uintptr_t> g_freed;  // addresses freed while recording, not yet taken
}  // namespace

// Read by Python without a call (ctypes in_dll): frees waiting to be taken.
extern "C" { std::atomic<std::uint64_t> tracefleet_num_freed{0}; }

namespace {
struct UniqueMetaAllocator final : c10::Allocator {
  // Far above any real heap address; 64-byte steps keep distinct allocations distinct.
  std::atomic<std::uintptr_t> next{std::uintptr_t{1} << 46};
  // The context is the address itself: the deleter learns which storage died.
  static void deleter(void* ctx) {
    if (ctx == nullptr || !g_recording.load(std::memory_order_relaxed) ||
        g_paused.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> lock(g_freed_mutex);
    g_freed.push_back(reinterpret_cast<std::uintptr_t>(ctx));
    tracefleet_num_freed.store(g_freed.size(), std::memory_order_relaxed);
  }
  c10::DataPtr allocate(size_t nbytes) override {
    void* p = reinterpret_cast<void*>(next.fetch_add((nbytes + 63) / 64 * 64 + 64));
    return {p, p, &deleter, c10::Device(c10::DeviceType::Meta)};
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

// Pauses (1) or resumes (0) recording without forgetting what was recorded.
extern "C" void tracefleet_unique_meta_pause_frees(int paused) {
  g_paused.store(paused != 0);
}

// The address the next allocation gets: every later allocation's is at least this.
extern "C" std::uint64_t tracefleet_unique_meta_next() { return g_unique.next.load(); }

extern "C" void tracefleet_unique_meta_record_frees(int on) {
  std::lock_guard<std::mutex> lock(g_freed_mutex);
  g_recording.store(on != 0);
  g_freed.clear();
  tracefleet_num_freed.store(0);
}

// Moves up to `capacity` freed addresses into `out`; returns how many.
extern "C" std::size_t tracefleet_unique_meta_take_freed(std::uint64_t* out,
                                                        std::size_t capacity) {
  std::lock_guard<std::mutex> lock(g_freed_mutex);
  std::size_t n = g_freed.size() < capacity ? g_freed.size() : capacity;
  for (std::size_t i = 0; i < n; ++i) out[i] = g_freed[g_freed.size() - n + i];
  g_freed.resize(g_freed.size() - n);
  tracefleet_num_freed.store(g_freed.size(), std::memory_order_relaxed);
  return n;
}

extern "C" int tracefleet_unique_meta_uninstall() {
  if (g_default != nullptr) c10::SetAllocator(c10::DeviceType::Meta, g_default, kPriority);
  return c10::GetAllocator(c10::DeviceType::Meta) == g_default;
}
"""
_TAKE_BATCH = 4096


def _library():
    return load_library("unique_meta", _SOURCE, "workload.device=meta (its meta allocator)")


@contextmanager
def record_frees():
    """Within the block, the unique meta allocator keeps the addresses of the storages freed
    (:func:`take_freed`, :func:`num_freed`); inside :func:`unique_meta_storages` only."""
    lib = _library()
    lib.tracefleet_unique_meta_record_frees(1)
    try:
        yield
    finally:
        lib.tracefleet_unique_meta_record_frees(0)


@contextmanager
def frees_paused():
    """Within the block, frees are not recorded (the recorder's own temporaries)."""
    lib = _library()
    lib.tracefleet_unique_meta_pause_frees(1)
    try:
        yield
    finally:
        lib.tracefleet_unique_meta_pause_frees(0)


def next_address() -> int:
    """The address of the next meta allocation (addresses only grow: a storage whose address is
    at least this one was made after the call; read before every recorded op, so the
    function is looked up once)."""
    return _next_function()()


@functools.lru_cache(maxsize=1)
def _next_function():
    function = _library().tracefleet_unique_meta_next
    function.restype = ctypes.c_uint64
    return function


def num_freed() -> int:
    """How many freed addresses wait to be taken (a read, no call into the library)."""
    return _counter().value


@functools.lru_cache(maxsize=1)
def _counter():
    return ctypes.c_uint64.in_dll(_library(), "tracefleet_num_freed")


def take_freed() -> list[int]:
    """The addresses freed since the last call (while :func:`record_frees` is on)."""
    lib = _library()
    lib.tracefleet_unique_meta_take_freed.restype = ctypes.c_size_t
    buf = (ctypes.c_uint64 * _TAKE_BATCH)()
    taken = []
    while True:
        n = lib.tracefleet_unique_meta_take_freed(buf, _TAKE_BATCH)
        taken.extend(buf[:n])
        if n < _TAKE_BATCH:
            return taken


@contextmanager
def unique_meta_storages():
    """Within the block, every new meta tensor gets its own data pointer (see module doc)."""
    lib = _library()
    if not lib.tracefleet_unique_meta_install():
        raise ConfigError("could not install the unique meta allocator (c10::SetAllocator)")
    try:
        yield
    finally:
        lib.tracefleet_unique_meta_uninstall()
