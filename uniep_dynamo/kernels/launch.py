"""Triton launches without Triton's per-call argument binder.

``kernel[grid](...)`` binds and specializes every argument on every call (about 20-30 us of host time per
launch of the MegaKernel's GEMMs on an H200 host, benchmarks/probes/launch_probe.py), which the EP pipeline
pays a few dozen times per layer. ``launch`` keys a cache by everything Triton specializes a compiled kernel
on, computed in plain Python, and calls the cached compiled kernel directly:

    tensor      dtype, data pointer a multiple of 16 bytes
    int         multiple of 16, equal to 1, fits int32 / int64
    bool/float  the type; None: None
    constexpr   the value itself
    options     num_warps, num_stages, ... and the current device

A key seen for the first time launches through ``kernel[grid]`` (compiling if needed) and caches what it
returns. Two calls with one key are the same specialization, so the compiled kernel is the one Triton's own
binder would pick. The interpreter (CPU tensors) always goes through ``kernel[grid]``.
"""
from __future__ import annotations

import os

import torch

_CACHE: dict = {}
_ENABLED = os.environ.get("UNIEP_TRITON_BINDER", "") != "1"  # UNIEP_TRITON_BINDER=1: always Triton's own path


def _key(value, constexpr: bool):
    if constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        return (value % 16 == 0, value == 1, -2**31 <= value < 2**31, -2**63 <= value < 2**63)
    if value is None:
        return None
    return type(value)


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), the binder skipped once this specialization has been launched."""
    first = args[0] if args else None
    if not _ENABLED or not isinstance(first, torch.Tensor) or first.device.type != "cuda":
        return kernel[grid](*args, **kwargs)
    return _cached(kernel, grid, torch.cuda.current_device(), args, kwargs)


def _cached(kernel, grid, device: int, args, kwargs):
    names = kernel.arg_names
    try:
        values = list(args) + [kwargs[name] for name in names[len(args):]]
    except KeyError:  # an argument left to its default: Triton's own path
        return kernel[grid](*args, **kwargs)
    constexprs = _constexprs(kernel)
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in _names(kernel)))
    key = (kernel, device, options,
           tuple(_key(v, i in constexprs) for i, v in enumerate(values)))
    compiled = _CACHE.get(key)
    if compiled is None:
        _CACHE[key] = kernel[grid](*args, **kwargs)
        return _CACHE[key]
    grid = tuple(grid)
    compiled[grid + (1,) * (3 - len(grid))](*values)
    return compiled


_META: dict = {}


def _constexprs(kernel) -> frozenset:
    meta = _META.get(kernel)
    if meta is None:
        meta = _META[kernel] = (frozenset(kernel.constexprs), frozenset(kernel.arg_names))
    return meta[0]


def _names(kernel) -> frozenset:
    return _META[kernel][1]
