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

``gated``  h[r], act[r] = A[a_row(r)] @ B[e(r)] and silu(gate) * up of it, by QuACK's gated GEMM (``gemm_gated``):
           the activation from the fp32 accumulator in the epilogue, B's [gate; up] column halves read interleaved,
           h stored interleaved (column 2j gate j, 2j + 1 up j). config.gated_epilogue's up projection.

``dgated`` the activation-gradient GEMM with the SwiGLU backward and the routing weight's gradient in its epilogue
           (``gemm_dgated``), over the interleaved h: config.gated_epilogue's backward under late_routing_weight.

``concat`` on ``rows`` / ``wgrad``: B's K rows (``rows``) or the output's strided dimension (``wgrad``) are a [gate; up]
pair of halves that the other operand holds interleaved (QuACK's ``concat_layout``): the GEMMs of the gated layout's
backward, against the weight as the model stores it.

The config string names QuACK's tile: ``"<tile_m>x<tile_n>/<pingpong|coop>/<cluster_m>x<cluster_n>"``. Where QuACK
cannot run the GEMM (not installed, not a Hopper GPU, not bf16, operands it does not take) ``usable`` says so and the
caller takes its other path; ``UNIEP_QUACK=0`` turns the knob off everywhere.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
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
    the same GEMM by its other path, which gives the same bits). A kernel not launched before a capture
    (NotCompiledBeforeCapture) leaves the knob on: only that call takes the other path."""
    if isinstance(exc, NotCompiledBeforeCapture):
        return
    if not _FAILED:
        _FAILED.append(f"a QuACK GEMM failed earlier ({type(exc).__name__}: {str(exc)[:200]})")
        log.warning("uniep: the quack GEMM knob is off for this process: %s", _FAILED[0])


def failure() -> str | None:
    """What turned the knob off for this process (failed), or None."""
    return _FAILED[0] if _FAILED else None


def unavailable_reason(device) -> str | None:
    """None where QuACK's GEMMs can run on ``device``, else why not."""
    if _FAILED:
        return _FAILED[0]
    return installed_reason(device)


def installed_reason(device) -> str | None:
    """unavailable_reason without a failure earlier in this process: what does not change between a forward and its
    backward (config.gated_epilogue's layout is decided by it)."""
    if os.environ.get("UNIEP_QUACK", "1") == "0":
        return "UNIEP_QUACK=0"
    if device.type != "cuda":
        return "not a CUDA device"
    if not _device_ok(device):
        return "not a Hopper GPU (its configs here are Hopper's)"
    return _module()[1]


_WARNED: set = set()


class NotCompiledBeforeCapture(RuntimeError):
    """A CUDA graph is being captured and this QuACK kernel was not launched before it: compiling and loading a kernel
    is no work to record, so this one call takes the other GEMMs (the same bits); the knob stays on."""


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def usable(device, config: str) -> bool:
    """A config is set and QuACK runs here; the first refusal of each kind is logged. While a CUDA graph is being
    captured, only by the direct launch (rows / wgrad raise NotCompiledBeforeCapture for a kernel it has not
    launched before; a warm-up step before the capture launches them all, as inductor's CUDA graphs run one)."""
    if not config or (_capturing(device) and not _direct_serves(device)):
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
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


@functools.lru_cache(maxsize=1)
def _direct_parts():
    """QuACK 0.4.1's internals that its ``gemm`` goes through on every call, for the direct launch; None where this is
    another QuACK release (its public entry point then runs)."""
    try:
        import quack
        if getattr(quack, "__version__", None) != TESTED_VERSION:
            return None
        from quack import cache_utils
        from quack import gemm as quack_gemm
        from quack.cute_dsl_utils import get_device_capacity, get_max_active_clusters, torch2cute_dtype_map
        from quack.gemm_default_epi import GemmDefaultEpiMixin
        from quack.gemm_tvm_ffi_utils import make_scheduler_args
        from quack.rounding import RoundingMode
        from quack.varlen_utils import VarlenArguments
    except Exception:  # noqa: BLE001 -- its internals moved: the public entry point serves
        return None
    return quack_gemm._compile_gemm, get_max_active_clusters, torch2cute_dtype_map, GemmDefaultEpiMixin, \
        make_scheduler_args, RoundingMode, VarlenArguments, get_device_capacity, cache_utils


_LAUNCHERS: dict = {}


def _launcher(config: str, varlen_m: bool, gather: bool, a_major: str, b_major: str, d_major: str, dtypes, capacity,
              concat: tuple = ()):
    """(compiled kernel, epilogue arguments, scheduler arguments) of one kind of call: what QuACK's ``gemm`` works out
    on every call (its compile cache's 30-part key, the cluster count, the argument tuples), worked out once. The
    compile key is the one its ``gemm`` uses, so both paths share one compiled kernel."""
    key = (config, varlen_m, gather, a_major, b_major, d_major, dtypes, capacity, concat)
    hit = _LAUNCHERS.get(key)
    if hit is not None:
        return hit
    compile_gemm, max_active_clusters, dtype_map, epilogue, scheduler_args, rounding = _direct_parts()[:6]
    tile_m, tile_n, pingpong, cluster_m, cluster_n = parse_config(config)
    a_dtype, b_dtype, d_dtype = (dtype_map[d] for d in dtypes)
    kernel = compile_gemm(a_dtype, b_dtype, d_dtype, None, a_major, b_major, d_major, None, (tile_m, tile_n),
                          (cluster_m, cluster_n, 1), pingpong, True, False, None, None, 0, 0, 0, False, concat, varlen_m,
                          not varlen_m, gather, False, False, capacity, rounding.RN, 0, False, None)
    epi = epilogue.EpilogueArguments(alpha=None, beta=None, mRowVecBroadcast=None, mColVecBroadcast=None,
                                     add_to_output=None, rounding_mode=None, sr_seed=None)
    sched = scheduler_args(max_active_clusters(cluster_m * cluster_n, device_capacity=capacity), 8, None, None)
    _LAUNCHERS[key] = hit = (kernel, epi, sched)
    return hit


def _major(t, first: str, second: str) -> str:
    return second if t.stride(1) == 1 else first


def _direct_serves(device) -> bool:
    """The direct launch runs here: a CUDA device, QuACK's tested release, UNIEP_QUACK_DIRECT not 0, not one of QuACK's
    compile workers (which set COMPILE_ONLY: nothing to launch)."""
    if os.environ.get("UNIEP_QUACK_DIRECT", "1") == "0" or device.type != "cuda":
        return False
    parts = _direct_parts()
    return parts is not None and not parts[8].COMPILE_ONLY


def _direct(a, b, out, config: str, cu_seqlens_m=None, cu_seqlens_k=None, a_idx=None, concat: tuple = ()) -> bool:
    """QuACK's GEMM launched as its ``gemm`` launches it (gemm_tuned -> gemm -> the compiled kernel, same arguments),
    without the Python it repeats on every call (on an H100's host, quack_launch_probe.py: 16-27 µs a launch against
    34-51 through the entry point; a synchronized step waits for the host wherever the GPU's queue runs dry). False
    where the direct launch does not serve (another QuACK release, UNIEP_QUACK_DIRECT=0): the caller takes the public
    entry point."""
    if not _direct_serves(a.device):
        return False
    parts = _direct_parts()
    varlen_m = cu_seqlens_m is not None
    b_t = b.mT  # QuACK's gemm_tuned takes B as [K, N] (or [E, K, N]) and hands its transpose on
    if varlen_m:  # A [rows, K], B [E, N, K] as [N, K, E], D [rows, N]
        b_p, d_p = b_t.permute(1, 2, 0), out
    else:  # A [M, rows] m-major, B [N, rows], D [E, M, N] as [M, N, E]
        b_p, d_p = b_t, out.permute(1, 2, 0)
    majors = (_major(a, "m", "k"), _major(b_p, "n", "k"), _major(d_p, "m", "n"))
    capacity = parts[7](a.device)
    key = (config, varlen_m, a_idx is not None, *majors, (a.dtype, b.dtype, out.dtype), capacity, concat)
    if key not in _LAUNCHERS and _capturing(a.device):
        raise NotCompiledBeforeCapture(f"QuACK GEMM {config} was not launched before this CUDA graph capture")
    kernel, epi, sched = _launcher(*key)
    kernel(a, b_p, d_p, None, epi, sched, parts[6](mCuSeqlensM=cu_seqlens_m, mCuSeqlensK=cu_seqlens_k, mAIdx=a_idx),
           None)
    return True


def _concat_kwargs(concat: tuple) -> dict:
    return {"concat_layout": concat} if concat else {}


def rows(a, b, out, cu_seqlens, config: str, a_idx=None, concat: bool = False):
    """out [rows, N] = a[a_idx or rows] @ b[e] per expert group of ``cu_seqlens`` ([E + 1] int32, from 0); with
    ``concat``, b's K rows are [gate; up] halves that a's K columns hold interleaved (b must be N-contiguous)."""
    names = ("B",) if concat else ()
    with _on(a.device):
        if not _direct(a, b, out, config, cu_seqlens_m=cu_seqlens, a_idx=a_idx, concat=names):
            _module()[0][0](a, b, out, cu_seqlens_m=cu_seqlens, A_idx=a_idx, config=_config(config),
                            **_concat_kwargs(names))
    return out


def wgrad(a_t, b, out, cu_seqlens, config: str, a_idx=None, concat: bool = False):
    """out [E, M, N] = a_t[:, group] @ b[group] per expert group of rows; ``a_t`` [M, rows or tokens], m-major. With
    ``concat``, out's strided dimension (M where out is N-contiguous, else N) is [gate; up] halves that the operand
    along it holds interleaved."""
    names = ("out",) if concat else ()
    with _on(a_t.device):
        if not _direct(a_t, b, out, config, cu_seqlens_k=cu_seqlens, a_idx=a_idx, concat=names):
            _module()[0][0](a_t, b, out, cu_seqlens_k=cu_seqlens, A_idx=a_idx, config=_config(config),
                            **_concat_kwargs(names))
    return out


def _entry_point(name: str, arguments: set):
    """The function of QuACK's autotuned entry point ``name`` in quack.gemm_interface, or None where this QuACK has
    none taking ``arguments``."""
    try:
        from quack import gemm_interface
    except Exception:  # noqa: BLE001 -- not importable
        return None
    tuned = getattr(gemm_interface, name, None)
    if tuned is None or not arguments <= set(inspect.signature(tuned.fn).parameters):
        return None
    return tuned.fn


@functools.lru_cache(maxsize=1)
def _gated_entry():
    """QuACK's gated GEMM (gemm_gated_tuned's function), or None where this QuACK has none taking the arguments."""
    return _entry_point("gemm_gated_tuned", {"preact_out", "postact_out", "cu_seqlens_m", "A_idx", "config",
                                             "concat_layout", "activation"})


@functools.lru_cache(maxsize=1)
def _dgated_entry():
    """QuACK's gated-activation-gradient GEMM (gemm_dgated_tuned's function), or None where this QuACK has none
    taking the arguments."""
    return _entry_point("gemm_dgated_tuned", {"PreAct", "dx_out", "postact_out", "colvec_scale", "colvec_reduce",
                                              "cu_seqlens_m", "A_idx", "dynamic_scheduler", "config", "activation"})


def dgated(a, b, h, d_h, act, scale, cu_seqlens, config: str, a_idx=None):
    """config.gated_epilogue's activation backward in the activation-gradient GEMM's epilogue (QuACK's
    ``gemm_dgated``): g = a[a_idx or rows] @ b[e] (fp32, the unweighted output gradient times W_down^T), and from the
    interleaved h [rows, 2I]: d_h = dSwiGLU(h, scale * g) (interleaved, may be h itself), act = scale * SwiGLU(h)
    ([rows, I]); returns <g, SwiGLU(h)> a row ([rows] fp32: each column tile's part, then summed in tile order), the
    routing weight's gradient. ``scale`` [rows] fp32. Rows past the groups' end are not written. Raises as gated."""
    entry = _dgated_entry()
    if entry is None:
        raise RuntimeError("this quack-kernels has no gemm_dgated taking colvec_scale and colvec_reduce")
    key = ("dgated", config, a_idx is not None, a.dtype, a.device, b.stride(1) == 1, b.stride(2) == 1)
    if key not in _GATED_LAUNCHED and _capturing(a.device):
        raise NotCompiledBeforeCapture(f"QuACK dgated GEMM {config} was not launched before this CUDA graph capture")
    with _on(a.device):
        sums = entry(a, b, h, d_h, act, colvec_scale=scale, activation="swiglu", colvec_reduce=True,
                     cu_seqlens_m=cu_seqlens, A_idx=a_idx, dynamic_scheduler=False, config=_config(config))
    _GATED_LAUNCHED.add(key)
    return sums


def gates(config: str) -> bool:
    """QuACK's gated GEMM takes the config on a Hopper GPU (its epilogue needs tile_n a multiple of 32)."""
    return parse_config(config)[1] % 32 == 0


_GATED_LAUNCHED: set = set()  # the gated kernels launched in this process (a capture may replay only those)


def gated(a, b, h, act, cu_seqlens, config: str, a_idx=None):
    """h [rows, 2I] (interleaved: column 2j gate j, 2j + 1 up j) and act [rows, I] = silu(gate) * up, from
    a[a_idx or rows] @ b[e] with b's N columns [gate; up] halves (``b`` [E, K, 2I], K-contiguous): QuACK's gated
    GEMM, the activation from the fp32 accumulator. Raises RuntimeError where this QuACK has no gated GEMM, and
    NotCompiledBeforeCapture in a capture before its kernel was launched."""
    entry = _gated_entry()
    if entry is None:
        raise RuntimeError("this quack-kernels has no gemm_gated taking concat_layout")
    key = (config, a_idx is not None, a.dtype, a.device, b.stride(1) == 1, b.stride(2) == 1)
    if key not in _GATED_LAUNCHED and _capturing(a.device):
        raise NotCompiledBeforeCapture(f"QuACK gated GEMM {config} was not launched before this CUDA graph capture")
    with _on(a.device):
        entry(a, b, h, act, activation="swiglu", cu_seqlens_m=cu_seqlens, A_idx=a_idx, config=_config(config),
              concat_layout=("B",))
    _GATED_LAUNCHED.add(key)
    return h


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
