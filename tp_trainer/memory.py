"""Memory figures of a rank: peak process memory, device memory, and live activation bytes.

On CPU there is no allocator statistic, so activation memory is measured directly: every tensor
autograd saves for backward is counted (once per storage, parameters excluded) from the moment it
is saved until autograd frees it. The K/V buffers of the slice cache are saved tensors too, so they
are counted. Inside a non-reentrant activation checkpoint autograd uses the checkpoint's own hooks,
so what a checkpoint keeps (its inputs) is not seen: with checkpointing on, the figure is only the
part saved outside checkpoints. Peak RSS comes from the OS (ru_maxrss: the process high-water mark).
"""

from __future__ import annotations

import resource
import weakref
from contextlib import contextmanager

import torch


class ActivationTracker:
    """Live and peak bytes of tensors saved for backward (activations), excluding parameters."""

    def __init__(self, parameters=()):
        self._param_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._refs: dict[int, int] = {}      # storage ptr -> saved tensors still holding it
        self._sizes: dict[int, int] = {}     # storage ptr -> bytes
        self.live = 0
        self.peak = 0

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._param_storages or tensor.device.type == "meta":
            return tensor
        if self._refs.get(ptr, 0) == 0:
            self._sizes[ptr] = storage.nbytes()
            self.live += self._sizes[ptr]
            self.peak = max(self.peak, self.live)
        self._refs[ptr] = self._refs.get(ptr, 0) + 1
        handle = _Saved(tensor)
        weakref.finalize(handle, self._release, ptr)
        return handle

    def _release(self, ptr: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            self.live -= self._sizes.pop(ptr)
            del self._refs[ptr]

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    @contextmanager
    def track(self):
        """Count the tensors saved by autograd inside this block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def bytes_of(self, tensors) -> int:
        """Bytes of the storages of ``tensors`` that are counted as saved now (each storage once)."""
        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        return sum(self._sizes.get(ptr, 0) for ptr in ptrs)

    def reset_peak(self) -> None:
        self.peak = self.live


class _Saved:
    """What autograd keeps instead of the tensor; its collection marks the tensor as freed."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


_EARLIER_PEAK_MB = [0.0]   # the high-water mark before the last ``reset_hwm`` (peak_rss_mb keeps it)
_WINDOW_PEAK_MB = [0.0]    # the highest VmHWM that resets folded in since ``start_peak_window``
LEAN_MMAP_BYTES = 16 * 2 ** 10
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc mallopt parameters


def peak_rss_mb() -> float:
    """High-water mark of this process's resident memory, in MiB (Linux reports KiB); peaks from
    before a ``reset_hwm`` count too."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, _EARLIER_PEAK_MB[0])


_LEAN = [False]


def lean_heap(on: bool = True) -> bool:
    """``on``: make RSS follow the bytes in use. glibc's malloc then serves every allocation of
    >= 16 KiB (every tensor but the small ones; 64 KiB left slices of 32-64 tokens x 256 in the
    arenas, +30 MiB of RSS per step) with its own mapping, returned to the OS when freed,
    and trims its heap past 1 MiB free. Without it, freed tensor memory stays in the process
    (malloc's dynamic mmap threshold rises to 32 MiB after the first large free; freed pages are
    reused, not returned), so RSS grows step after step above the bytes held (measured: +40-100 MiB
    per stage over a 2-step run at 2k-4k tokens). Costs a page fault per fresh page.
    ``on=False``: back to the thresholds the dynamic default ends at (32 MiB mmap, 64 MiB trim).
    Process-wide and lasting. False where glibc's mallopt is not there."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        mmap, trim = (LEAN_MMAP_BYTES, 2 ** 20) if on else (32 * 2 ** 20, 64 * 2 ** 20)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap) and libc.mallopt(_M_TRIM_THRESHOLD, trim))
    except (OSError, AttributeError):
        return False
    _LEAN[0] = on and ok
    release_freed()
    return ok


@contextmanager
def leaned():
    """``lean_heap`` inside the block; after it, back to the default unless it was on before."""
    before = _LEAN[0]
    lean_heap(True)
    try:
        yield
    finally:
        if not before:
            lean_heap(False)


def hwm_mb() -> float:
    """VmHWM: this process's peak resident memory since the last ``reset_hwm``, in MiB (0: unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: /proc/self/clear_refs); the peak so far is kept
    for ``peak_rss_mb``. False where it cannot."""
    before = hwm_mb()
    _EARLIER_PEAK_MB[0] = max(_EARLIER_PEAK_MB[0], before)
    _WINDOW_PEAK_MB[0] = max(_WINDOW_PEAK_MB[0], before)
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        return False
    return hwm_mb() > 0


def start_peak_window() -> bool:
    """Measure the process's peak from now on (VmHWM reset); ``window_peak_mb`` reads it. The
    ``reset_hwm`` calls inside (``transient_peak``, the planner's profile) fold their VmHWM in first,
    so they do not hide the window's peak. False where VmHWM cannot be reset."""
    ok = reset_hwm()
    _WINDOW_PEAK_MB[0] = hwm_mb()
    return ok


def window_peak_mb() -> float:
    """Peak RSS (MiB) since ``start_peak_window`` (since the process began, without one)."""
    return max(_WINDOW_PEAK_MB[0], hwm_mb())


def is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


@contextmanager
def transient_peak(device=None, reserved: bool = False):
    """Measures the peak RSS inside the block above the RSS at its start (freed memory given back
    first): yields a dict whose "bytes" is set on exit (None where VmHWM cannot be reset). Exact to a
    page for allocations ``lean_heap`` maps; other threads' allocations count too. On a CUDA
    ``device``: the caching allocator's peak of allocated bytes above those allocated at the start;
    ``reserved``: of its reserved bytes instead, the cache emptied first (what the block held with
    the allocator's cache and CUDA graphs' private pools)."""
    out = {"bytes": None}
    if is_cuda(device):
        held = torch.cuda.memory_reserved if reserved else torch.cuda.memory_allocated
        peak = torch.cuda.max_memory_reserved if reserved else torch.cuda.max_memory_allocated
        torch.cuda.synchronize(device)
        if reserved:
            torch.cuda.empty_cache()   # what the cache holds from earlier work would hide the block's need
        start = held(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out["bytes"] = float(max(0, peak(device) - start))
        return
    release_freed()
    start = current_rss_mb()
    ok = reset_hwm()
    yield out
    if ok:
        out["bytes"] = max(0.0, hwm_mb() - start) * 2 ** 20


def release_freed() -> None:
    """Give memory that Python / torch freed back to the OS (glibc's malloc_trim), so RSS shows what is
    in use: a profile's freed activations would otherwise stay in the process's RSS."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def bytes_in_use(device=None) -> float:
    """What this process's tensors hold now: on a CUDA ``device`` the allocator's allocated bytes,
    elsewhere the resident set (``current_rss_mb``, after ``release_freed``)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)
        return float(torch.cuda.memory_allocated(device))
    release_freed()
    return current_rss_mb() * 2 ** 20


def device_used_mb(device=None) -> float:
    """What a memory limit counts, in MiB: on a CUDA ``device`` its used memory with the allocator's
    cache emptied first (the CUDA context and libraries' workspaces, and other processes', count: the
    limit is what the device has), elsewhere this process's resident set (``current_rss_mb``)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return (total - free) / 2 ** 20
    return current_rss_mb()


def used_above_mb(baseline_mb: float, device=None) -> float:
    """Memory used now above ``baseline_mb``: on CUDA the allocator's reserved bytes, elsewhere the RSS above it."""
    if is_cuda(device):
        return torch.cuda.memory_reserved(device) / 2 ** 20
    return current_rss_mb() - baseline_mb


def peak_above_mb(baseline_mb: float, device=None) -> float:
    """The most memory used so far above ``baseline_mb`` (``device_used_mb`` before the model): on CUDA
    the allocator's peak reserved bytes (what it held beyond the context), elsewhere the peak RSS above it."""
    if is_cuda(device):
        return torch.cuda.max_memory_reserved(device) / 2 ** 20
    return peak_rss_mb() - baseline_mb


def current_rss_mb() -> float:
    """This process's resident memory now, in MiB (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            pages = int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * resource.getpagesize() / 2 ** 20


def memory_report(device, tracker: ActivationTracker | None = None, budget: dict | None = None) -> str:
    """One line: peak RSS, device peak (CUDA), peak activations (``tracker`` None: that they were not
    tracked, the run's --no-memory_report); with a memory-aware plan's ``budget`` ({baseline_mb,
    predicted_mb, limit_mb}: ``initialize.memory_budget``) also the peak above the baseline beside the
    predicted peak and the limit."""
    parts = [f"peak rss {peak_rss_mb():.0f} MiB"]
    if budget:
        parts.append(f"above the {budget['baseline_mb']:.0f} MiB before the model "
                     f"{peak_above_mb(budget['baseline_mb'], device):.0f} "
                     f"MiB (predicted {budget['predicted_mb']:.0f} MiB, limit {budget['limit_mb']:.0f} MiB; "
                     f"{budget.get('built_mb', float('nan')):.0f} MiB once the engine was built)")
    if torch.device(device).type == "cuda":
        parts.append(f"device peak {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB")
    if tracker is not None:
        parts.append(f"peak saved activations {tracker.peak / 2**20:.1f} MiB (outside activation checkpoints)")
    else:
        parts.append("saved activations not tracked (--memory_report tracks them)")
    return ", ".join(parts)
