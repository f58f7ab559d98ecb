"""The MegaKernel's grouped GEMMs by QuACK (``quack-kernels`` on PyPI: CuTe-DSL GEMMs, persistent and warp-specialized,
with variable-length groups and a gathered A operand), a scheduling knob of each GEMM (``GemmConfig.quack``).

Why: on an H100 (bf16, Qwen3-30B-A3B shape, T = 8192; benchmarks/probes/quack_probe.py, BENCHMARKS.md 2026-11-25) its
grouped GEMMs run the six GEMMs of a layer in 3.83 ms against 4.41 ms for torch._grouped_mm and the two row gathers
that QuACK does inside the GEMM (each timed alone, synchronized, in one run), with the same bits: like
torch._grouped_mm and the Triton GEMMs it is a chain of wgmma instructions over K in order into an fp32 accumulator,
rounded once, with no split over K (config.py's numerics contract).

Two shapes of call:

``rows``   out[r] = A[a_row(r)] @ B[e(r)] for the expert-sorted rows r (``varlen_m``: groups of rows by
           ``cu_seqlens``); with ``a_idx``, a_row(r) = a_idx[r] (the token of row r: the gather of token rows in the
           GEMM's loads, no permuted copy).
``wgrad``  out[e] = A_e @ B_e, K = expert e's rows (``varlen_k``): A given as [M, rows] (a transposed row-major
           tensor), B as [rows, N]; with ``a_idx``, A's column k is column a_idx[k] of A.

The config string names QuACK's tile: ``"<tile_m>x<tile_n>/<pingpong|coop>/<cluster_m>x<cluster_n>"``. Where QuACK
cannot run the GEMM (not installed, not a Hopper GPU, not bf16, operands it does not take) ``usable`` says so and the
caller takes its other path; ``UNIEP_QUACK=0`` turns the knob off everywhere.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

log = logging.getLogger("uniep")

# The QuACK release these calls were written and measured against (its GEMM entry point's signature moves between
# releases); another version is used only if its entry point takes the same arguments.
TESTED_VERSION = "0.4.1"


def parse_config(text: str):
    """(tile_m, tile_n, pingpong, cluster_m, cluster_n) of a config string; ValueError when malformed."""
    try:
        tile, kind, cluster = text.split("/")
        tile_m, tile_n = (int(v) for v in tile.split("x"))
        cluster_m, cluster_n = (int(v) for v in cluster.split("x"))
    except ValueError:
        raise ValueError(f"uniep: quack config {text!r} is not '<tile_m>x<tile_n>/<pingpong|coop>/<cm>x<cn>'") from None
    if kind not in ("pingpong", "coop"):
        raise ValueError(f"uniep: quack config {text!r}: the schedule is 'pingpong' or 'coop'")
    if tile_m not in (64, 128, 192, 256) or not 16 <= tile_n <= 256 or tile_n % 16 \
            or (cluster_m, cluster_n) not in ((1, 1), (1, 2), (2, 1)):
        raise ValueError(f"uniep: quack config {text!r}: tile_m in 64/128/192/256, tile_n a multiple of 16 up to "
                         "256, cluster 1x1, 1x2 or 2x1")
    return tile_m, tile_n, kind == "pingpong", cluster_m, cluster_n


@functools.lru_cache(maxsize=1)
def _module():
    """QuACK's GEMM entry point and config class, or the reason they cannot be used (logged once)."""
    try:
        import quack
        from quack.gemm_interface import GemmConfig, gemm_tuned
    except Exception as exc:  # not installed, or its CUDA DSL does not load here
        return None, f"quack-kernels is not importable ({type(exc).__name__}: {exc})"
    version = getattr(quack, "__version__", "?")
    if version != TESTED_VERSION:
        import inspect

        params = inspect.signature(gemm_tuned.fn).parameters
        if not {"cu_seqlens_m", "cu_seqlens_k", "A_idx", "config"} <= set(params):
            return None, f"quack-kernels {version}'s gemm takes other arguments than {TESTED_VERSION}'s"
    return (gemm_tuned.fn, GemmConfig), None


@functools.lru_cache(maxsize=16)
def _device_ok(device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


_FAILED: list = []  # the first error a QuACK GEMM raised in this process: the knob is off from then on


def failed(exc: Exception) -> None:
    """A QuACK call raised: turn the knob off for this process, with a warning naming the error (the caller then runs
    the same GEMM by its other path, which gives the same bits)."""
    if not _FAILED:
        _FAILED.append(f"a QuACK GEMM failed earlier ({type(exc).__name__}: {str(exc)[:200]})")
        log.warning("uniep: the quack GEMM knob is off for this process: %s", _FAILED[0])


def failure() -> str | None:
    """What turned the knob off for this process (failed), or None."""
    return _FAILED[0] if _FAILED else None


def unavailable_reason(device) -> str | None:
    """None where QuACK's GEMMs can run on ``device``, else why not."""
    if os.environ.get("UNIEP_QUACK", "1") == "0":
        return "UNIEP_QUACK=0"
    if _FAILED:
        return _FAILED[0]
    if device.type != "cuda":
        return "not a CUDA device"
    if not _device_ok(device):
        return "not a Hopper GPU (its configs here are Hopper's)"
    return _module()[1]


_WARNED: set = set()


def usable(device, config: str) -> bool:
    """A config is set and QuACK runs here; the first refusal of each kind is logged. Not while a CUDA graph is being
    captured (its launch path was not measured under capture; the other GEMMs give the same bits)."""
    if not config or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return False
    reason = unavailable_reason(device)
    if reason is not None and reason not in _WARNED:
        _WARNED.add(reason)
        log.info("uniep: the quack GEMM knob falls back to the other GEMMs: %s", reason)
    return reason is None


def _config(text: str):
    tile_m, tile_n, pingpong, cluster_m, cluster_n = parse_config(text)
    return _module()[0][1](tile_m=tile_m, tile_n=tile_n, pingpong=pingpong, cluster_m=cluster_m, cluster_n=cluster_n,
                           is_dynamic_persistent=False, device_capacity=9)


def _on(device):
    """QuACK's launch takes the current device's context and stream: make ``device`` current for it."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def rows(a, b, out, cu_seqlens, config: str, a_idx=None):
    """out [rows, N] = a[a_idx or rows] @ b[e] per expert group of ``cu_seqlens`` ([E + 1] int32, from 0)."""
    gemm, _ = _module()[0]
    with _on(a.device):
        gemm(a, b, out, cu_seqlens_m=cu_seqlens, A_idx=a_idx, config=_config(config))
    return out


def wgrad(a_t, b, out, cu_seqlens, config: str, a_idx=None):
    """out [E, M, N] = a_t[:, group] @ b[group] per expert group of rows; ``a_t`` [M, rows or tokens], m-major."""
    gemm, _ = _module()[0]
    with _on(a_t.device):
        gemm(a_t, b, out, cu_seqlens_k=cu_seqlens, A_idx=a_idx, config=_config(config))
    return out


def gathers(config: str) -> bool:
    """The config can gather A's rows (QuACK's gather takes clusters of one CTA along N)."""
    return parse_config(config)[4] == 1


def operands_ok(a, b, out=None) -> bool:
    """bf16, 16-byte aligned bases and strides, one unit stride in each operand's last two dimensions (TMA)."""
    tensors = [t for t in (a, b, out) if t is not None]
    if any(t.dtype != torch.bfloat16 for t in tensors):
        return False
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        strides = t.stride()
        if 1 not in strides[-2:]:
            return False
        if any(s != 1 and (s * t.element_size()) % 16 for s in strides):
            return False
    return True
