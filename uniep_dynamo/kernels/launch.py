"""Triton launches with less host time than ``kernel[grid](...)``.

``kernel[grid](*args, **kwargs)`` binds and specializes the arguments (Triton's generated binder), then builds a
string cache key, reads Triton's knobs, checks the kernel's global values and asks for launch metadata before it
calls the compiled kernel's launcher. The EP layer issues 30-50 launches a step, and on the GPU hosts the step's
host time is about its GPU time (BENCHMARKS.md), so those microseconds count.

``launch`` keeps Triton's binder, so a kernel is looked up under exactly Triton's specialization (pointer
alignment, integer divisibility, every constexpr, the launch options), and calls the launcher of the compiled
kernel found under that key itself. A miss, or anything it does not handle (the interpreter, a launch hook,
pre-run hooks, a Triton whose JITFunction or launcher differs from what it uses), goes through
``kernel[grid](...)``, which compiles the kernel or finds it in Triton's cache; the compiled kernel it returns is
kept for the next call.

What it skips, and why that is safe here: the check that the kernel's global values have not changed since it
was compiled (uniep's kernels read no mutable globals), and Triton's ``debug`` and instrumentation knobs at each
launch (read when the kernel is first compiled under a key, as Triton's own cache key does for a run of a process
that keeps them unchanged). ``UNIEP_TRITON_LAUNCH=triton`` turns the fast path off.
"""
from __future__ import annotations

import logging
import os

import torch

_KERNELS: dict = {}  # (kernel, device, Triton's specialization, launch options) -> compiled kernel
_RUNTIME: list = []  # Triton's runtime knobs and its driver's get_current_stream (_runtime)
FAST = os.environ.get("UNIEP_TRITON_LAUNCH", "") != "triton"
counts = {"fast": 0, "triton": 0}  # launches by each path (tests read them)


def _binder(fn, caches, device):
    """Triton's binder of fn on device (from its device_caches), or None where fn has pre-run hooks or this
    Triton's JITFunction does not have the layout used."""
    if getattr(fn, "pre_run_hooks", None):
        return None
    try:
        entry = caches[device]
    except Exception:  # noqa: BLE001 -- another Triton's layout: take its own launch path
        return None
    return entry[4] if isinstance(entry, tuple) and len(entry) == 5 and callable(entry[4]) else None


def _hooked(hook) -> bool:
    """Whether a launch hook of Triton's knobs is set: None, or (Triton >= 3.5) a HookChain with no calls, is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _runtime():
    """(Triton's runtime knobs, its driver's get_current_stream), looked up once."""
    if not _RUNTIME:
        from triton import knobs
        from triton.runtime.driver import driver

        _RUNTIME.extend((knobs.runtime, driver.active.get_current_stream))
    return _RUNTIME


def _disable(exc) -> None:
    global FAST
    FAST = False
    counts["triton"] += 1
    logging.getLogger("uniep").warning("uniep: Triton launches go through kernel[grid](...): this Triton's compiled "
                                       "kernels take other launcher arguments (%s)", exc)


def launch(fn, grid, *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)`` for a @triton.jit kernel ``fn`` and a grid tuple of 1 to 3 ints."""
    caches = getattr(fn, "device_caches", None) if FAST else None
    if caches is not None:
        runtime, stream = _runtime()
        device = torch.cuda.current_device()
        binder = _binder(fn, caches, device)
        if binder is not None and not _hooked(runtime.launch_enter_hook) and not _hooked(runtime.launch_exit_hook):
            bound, specialization, options = binder(*args, **kwargs)
            key = (fn, device, tuple(specialization), tuple(options.items()))
            kernel = _KERNELS.get(key)
            if kernel is not None:
                try:
                    kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                               stream(device), kernel.function, kernel.packed_metadata, None, None, None,
                               *bound.values())
                except TypeError as exc:  # a Triton whose launcher takes other arguments: its own path from now on
                    _disable(exc)
                    fn[grid](*args, **kwargs)
                    return
                counts["fast"] += 1
                return
            kernel = fn[grid](*args, **kwargs)
            counts["triton"] += 1
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            if hasattr(kernel, "run") and hasattr(kernel, "packed_metadata") and hasattr(kernel, "function"):
                _KERNELS[key] = kernel
            return
    counts["triton"] += 1
    fn[grid](*args, **kwargs)
