"""A count of the CPU allocator's live bytes that sees allocations and frees in every thread.

The torch profiler's allocator events are recorded only in threads carrying its state, so a
tensor that gloo's worker thread frees (FSDP2's reduce-scatter clones its input there) is
never seen freed and a running sum of events overstates the peak. This counter instead wraps
torch's CPU allocator (``c10::SetAllocator``): every block it hands out is counted by the
requested bytes, and the block's deleter, which runs in whatever thread frees it, subtracts
them. Blocks made before :func:`install` keep the original deleter and are never counted;
blocks of an earlier installation carry its epoch and are not subtracted from a later one.

Each counted block is 64 bytes longer than asked for: a header in front holds the previous
allocator's context and deleter, so the data pointer stays its own context (torch's "simple"
data pointer: oneDNN's raw_allocate/raw_deallocate and copy-on-write storages rely on it)
and the 64-byte alignment is kept. The profiler, if running, sees those 64 bytes per block.
Cost per allocation: three atomic updates, no lock.

The C++ is compiled once by :mod:`actors.native`. Every :func:`install` starts a fresh count
from zero (one measurer at a time: a later install takes the count over); installs nest, and
the last :func:`uninstall` restores the previous allocator.
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

namespace {
constexpr size_t kHeader = 64;  // the CPU allocator's alignment (c10/core/alignment.h)
struct Header {
  void* inner_context;
  c10::DeleterFnPtr inner_deleter;
  int64_t nbytes;
  uint64_t epoch;
};
static_assert(sizeof(Header) <= kHeader, "header must fit in front of the data");

std::atomic<int64_t> g_current{0}, g_peak{0}, g_blocks{0};
std::atomic<uint64_t> g_epoch{0};
std::mutex g_install_mutex;
int g_installs = 0;
c10::Allocator* g_previous = nullptr;  // kept after uninstall: a stale caller still works
constexpr uint8_t kPriority = 100;  // above the built-in registration's 0

void counting_delete(void* data) {
  if (data == nullptr) return;
  Header h = *reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
  if (h.epoch == g_epoch.load(std::memory_order_relaxed)) {
    g_current.fetch_sub(h.nbytes, std::memory_order_relaxed);
    g_blocks.fetch_sub(1, std::memory_order_relaxed);
  }
  h.inner_deleter(h.inner_context);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = g_previous->allocate(nbytes == 0 ? 0 : nbytes + kHeader);
    c10::Device device = inner.device();
    // torch's own allocator gives no block for 0 bytes; another might: then it gets a header
    if (nbytes == 0 && inner.get() == nullptr) return {nullptr, nullptr, &counting_delete, device};
    if (nbytes == 0) inner = g_previous->allocate(kHeader);
    char* base = static_cast<char*>(inner.get());
    auto* h = reinterpret_cast<Header*>(base);
    h->nbytes = static_cast<int64_t>(nbytes);
    h->epoch = g_epoch.load(std::memory_order_relaxed);
    h->inner_deleter = inner.get_deleter();
    h->inner_context = inner.release_context();
    int64_t now = g_current.fetch_add(h->nbytes, std::memory_order_relaxed) + h->nbytes;
    g_blocks.fetch_add(1, std::memory_order_relaxed);
    int64_t peak = g_peak.load(std::memory_order_relaxed);
    while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    return {base + kHeader, base + kHeader, &counting_delete, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
CountingAllocator g_counting;
}  // namespace

extern "C" int tracefleet_cpu_counter_install() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  g_epoch.fetch_add(1);  // a fresh count: blocks counted so far are never subtracted from it
  g_current = 0;
  g_peak = 0;
  g_blocks = 0;
  if (g_installs == 0) {
    g_previous = c10::GetAllocator(c10::DeviceType::CPU);
    c10::SetAllocator(c10::DeviceType::CPU, &g_counting, kPriority);
    if (c10::GetAllocator(c10::DeviceType::CPU) != &g_counting) return 0;
  }
  ++g_installs;
  return 1;
}

extern "C" int tracefleet_cpu_counter_uninstall() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  if (g_installs == 0) return 1;
  if (--g_installs == 0) c10::SetAllocator(c10::DeviceType::CPU, g_previous, kPriority);
  return c10::GetAllocator(c10::DeviceType::CPU) == (g_installs ? &g_counting : g_previous);
}

extern "C" int tracefleet_cpu_counter_installed() {
  return c10::GetAllocator(c10::DeviceType::CPU) == &g_counting;
}
extern "C" int64_t tracefleet_cpu_counter_epoch() { return g_epoch.load(); }
extern "C" int64_t tracefleet_cpu_counter_current() { return g_current.load(); }
extern "C" int64_t tracefleet_cpu_counter_peak() { return g_peak.load(); }
extern "C" int64_t tracefleet_cpu_counter_blocks() { return g_blocks.load(); }
extern "C" int64_t tracefleet_cpu_counter_reset_peak() {
  int64_t now = g_current.load();
  g_peak = now;
  return now;
}
"""
PURPOSE = "measuring CPU memory (replay.measure_memory, capture's memory meter)"


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = load_library("cpu_counter", _SOURCE, PURPOSE)
    for name in ("epoch", "current", "peak", "blocks", "reset_peak"):
        getattr(lib, f"tracefleet_cpu_counter_{name}").restype = ctypes.c_int64
    return lib


def install() -> None:
    """Count CPU allocations from now on, from zero (blocks counted before are forgotten)."""
    if not _lib().tracefleet_cpu_counter_install():
        raise ConfigError("could not install the CPU allocation counter (c10::SetAllocator "
                          "kept another allocator registered with a higher priority)")


def uninstall() -> None:
    """Undo one :func:`install`; the last restores the previous CPU allocator."""
    if not _lib().tracefleet_cpu_counter_uninstall():
        raise ConfigError("could not restore the CPU allocator the counter replaced")


def installed() -> bool:
    """Whether the counter is torch's CPU allocator right now."""
    return bool(_lib().tracefleet_cpu_counter_installed())


def count_id() -> int:
    """Which count is running: every :func:`install` starts a new one."""
    return _lib().tracefleet_cpu_counter_epoch()


def current_bytes() -> int:
    """Bytes of the counted blocks alive now (requested sizes)."""
    return _lib().tracefleet_cpu_counter_current()


def peak_bytes() -> int:
    """Highest :func:`current_bytes` since the install or the last :func:`reset_peak`."""
    return _lib().tracefleet_cpu_counter_peak()


def num_live_blocks() -> int:
    """Counted blocks alive now."""
    return _lib().tracefleet_cpu_counter_blocks()


def reset_peak() -> int:
    """Start a new peak at the bytes alive now; returns them."""
    return _lib().tracefleet_cpu_counter_reset_peak()


@contextmanager
def counting():
    """Install the counter for the block (see :func:`install`)."""
    install()
    try:
        yield
    finally:
        uninstall()
