"""The single-GPU MegaKernel: the uniep experts op's forward and backward as Triton launches.

Forward (S = T*K slots, rows in the routing plan's (expert, token, k) order):

    routing_plan                 counting sort of the slots by expert        (triton_routing)
    up    = X[tok(r)] @ W_up[e]  token rows copied into row order by a gather kernel (or read by the
                                 GEMM itself with fuse_gather); epilogue stores h (saved) and act(h)
    down  = act @ W_down[e]      (+ b_down); stored unweighted (saved: the routing-weight gradient)
    out   = combine(down, w)     k in order, fp32

Backward, from the same plan:

    d_w        = <dY[t], down[row]>                                   fixed-order kernel
    grad_act   = (w * dY[tok(r)]) @ W_down[e]^T, then d act/d h at the saved h -> d_h and act(h) again
               (an element-wise pass)
    d_W_down   = act^T @ (w * dY[tok(r)]) per expert (+ d_b_down)     no split over rows
    d_x rows   = d_h @ W_up[e]^T
    d_W_up     = X[tok(r)]^T @ d_h per expert (+ d_b_up)
    d_hidden   = combine(d_x rows), k in order, fp32

The op saves the same tensors as the reference (``up`` = h, ``down`` = the unweighted down rows), so
either implementation's backward can consume either forward's results.

``unsupported_reason`` says why a call runs the reference instead; the op logs each reason once.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading

import torch
from torch._dynamo.utils import counters

from . import config as config_mod
from .config import cdiv as _cdiv
from . import gate_program
from .launch import launch

log = logging.getLogger("uniep")
_LOGGED: set = set()  # (op, reason) pairs already logged
FUSED_DTYPES_GPU = (torch.bfloat16, torch.float16)
FUSED_DTYPES_INTERPRETER = (torch.float32, torch.float16)
MAX_EXPERTS = 1024


def triton_available() -> bool:
    """Whether triton can be imported (the fused kernels' one requirement beyond torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_mode() -> str:
    """UNIEP_KERNELS: "auto" (Triton on CUDA, reference on CPU), "triton" (Triton also on CPU, through
    the interpreter: TRITON_INTERPRET=1 must be set before triton is imported), "reference"."""
    mode = os.environ.get("UNIEP_KERNELS", "auto")
    if mode not in ("auto", "triton", "reference"):
        raise ValueError(f"uniep: UNIEP_KERNELS={mode!r}; expected auto, triton or reference")
    return mode


def _path_reason(hidden) -> str | None:
    """Why no Triton kernel can run for this tensor at all (mode, device, interpreter, install), or None.
    Shared by the experts and the router op; imports nothing from triton."""
    mode = kernels_mode()
    if mode == "reference":
        return "UNIEP_KERNELS=reference"
    if hidden.device.type != "cuda":
        if mode != "triton":
            return "not a CUDA tensor: the reference is the CPU path"
        if not config_mod.interpreting():
            return _forced_but_unable("on CPU tensors Triton's kernels run only in its interpreter: set "
                                      "TRITON_INTERPRET=1 before anything imports triton")
    if not triton_available():
        reason = "triton is not installed (pip install uniep[triton])"
        return _forced_but_unable(reason) if mode == "triton" else reason
    return None


def triton_runs(t) -> bool:
    """Triton's kernels can run on ``t``'s device (the mode, the device or the interpreter, the install allow it)."""
    return _path_reason(t) is None


def _forced_but_unable(why: str) -> str:
    """UNIEP_KERNELS=triton where no Triton kernel can run: the ops run the reference, as under "auto" (a shape
    or dtype the kernels do not take runs it too), but the user asked for Triton, so say so once, whatever the
    device (log_fallback is quiet on CPU, where the reference is the expected path)."""
    reason = f"UNIEP_KERNELS=triton, but {why}"
    if ("UNIEP_KERNELS", reason) not in _LOGGED:
        _LOGGED.add(("UNIEP_KERNELS", reason))
        log.warning("uniep: %s; the uniep ops run the PyTorch reference", reason)
    return reason


def unsupported_reason(hidden, topk_ids, w_up, w_down, b_up, b_down, post_operands, spec) -> str | None:
    """None if the Triton MegaKernel takes this call, else why the reference runs it."""
    reason = _path_reason(hidden)
    if reason is not None:
        return reason
    fused = FUSED_DTYPES_INTERPRETER if hidden.device.type != "cuda" else FUSED_DTYPES_GPU
    dtypes = {t.dtype for t in (hidden, w_up, w_down, b_up, b_down) if t is not None}
    if len(dtypes) != 1 or hidden.dtype not in fused:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
        return (f"hidden states, expert weights and biases are {names}; the fused kernels take one of "
                f"{', '.join(str(d).replace('torch.', '') for d in fused)} (float32 on CUDA runs the cuBLAS reference)")
    if spec.post is not None or post_operands:
        return "the layer has a post-expert program or program operands, which only the reference evaluates"
    if _gate_plan(spec.gate)[0] is None:
        return f"gate program {gate_program.describe(spec.gate)} has no fused kernel"
    if w_up.shape[0] > MAX_EXPERTS:
        return f"{w_up.shape[0]} experts; the fused tile schedule takes at most {MAX_EXPERTS}"
    if topk_ids.dtype not in (torch.int32, torch.int64):
        return f"top-k ids are {topk_ids.dtype}"
    from .triton_routing import MAX_SLOTS

    if topk_ids.numel() >= MAX_SLOTS:
        return f"{topk_ids.numel()} routed slots; the routing-plan kernels count in int32 (< {MAX_SLOTS})"
    return None


@functools.lru_cache(maxsize=256)
def _gate_plan(gate: str):
    """(activation name or None, (alpha, limit, up_add), split) of a gate program: decoded once per
    program, not on every op call."""
    return (gate_program.classify(gate), gate_program.clamped_glu_params(gate) or (0.0, 0.0, 0.0),
            gate_program.decode(gate)[0])


def warn_once(op: str, reason: str, message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` (a format with one %s, the reason) once per (op, reason): the EP layers say so when they
    run their sequential steps instead of the overlapped ones; ``level`` logging.INFO where a default ("auto")
    chose the path."""
    if (op, reason) not in _LOGGED:
        _LOGGED.add((op, reason))
        log.log(level, message, reason)


def log_fallback(op: str, reason: str, hidden) -> None:
    """One log line per (op, reason) on CUDA, where the reference is the slow path."""
    if (op, reason) not in _LOGGED and hidden.device.type == "cuda":
        _LOGGED.add((op, reason))
        log.warning("uniep: %s runs the PyTorch reference, not the fused kernels: %s", op, reason)


def use_megakernel(hidden, topk_ids, w_up, w_down, b_up, b_down, post_operands, spec) -> bool:
    reason = unsupported_reason(hidden, topk_ids, w_up, w_down, b_up, b_down, post_operands, spec)
    if reason is not None:
        log_fallback("experts op", reason, hidden)
    return reason is None


def backward_reads_down(hidden, topk_ids, w_up, w_down, b_up, b_down, post_operands, spec) -> bool:
    """Whether the op's backward needs the forward's ``down`` ([rows, H]) kept: not where the fused kernels run it
    under config.late_routing_weight without a down bias (experts_backward then reads none, and allocates the
    [rows, H] scratch the in-place backward took from it)."""
    return not (b_down is None and not post_operands and config_mod.late_routing_weight_on(
        hidden.device.type != "cuda")
        and unsupported_reason(hidden, topk_ids, w_up, w_down, b_up, b_down, post_operands, spec) is None)


ROUTER_MAX_EXPERTS = 1024


def router_unsupported_reason(hidden, weight, bias, spec) -> str | None:
    """None if the fused routing kernels (triton_router.py) take this router call, else why the
    reference runs it."""
    reason = _path_reason(hidden)
    if reason is not None:
        return reason
    fused = (torch.float32, torch.float16) if hidden.device.type != "cuda" else \
        (torch.float32, torch.float16, torch.bfloat16)
    if hidden.dtype not in fused or weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        return f"hidden {hidden.dtype}, router weight {weight.dtype}: the fused router takes one of {fused}"
    if spec.num_experts > ROUTER_MAX_EXPERTS:
        return f"{spec.num_experts} experts; the fused router takes at most {ROUTER_MAX_EXPERTS}"
    if spec.n_group > 1 and (spec.num_experts < 16 or spec.num_experts & (spec.num_experts - 1)
                             or spec.n_group & (spec.n_group - 1) or spec.num_experts // spec.n_group < 2):
        return (f"group-limited routing over E={spec.num_experts} in {spec.n_group} groups: the fused router "
                "takes E a power of two >= 16 in power-of-two groups of at least 2")
    if hidden.dim() != 2:
        return "hidden states are not 2-D"
    from .triton_routing import MAX_SLOTS

    if spec.plan and hidden.shape[0] * spec.top_k >= MAX_SLOTS:
        return f"{hidden.shape[0] * spec.top_k} routed slots; the routing-plan kernels count in int32"
    return None


def use_fused_router(hidden, weight, bias, spec) -> bool:
    reason = router_unsupported_reason(hidden, weight, bias, spec)
    if reason is not None:
        log_fallback("router op", reason, hidden)
    return reason is None


class Layer:
    """Shapes, weight views and launch constants of one call: what rows_gemm, act_backward and weight_grad take.
    The EP pipeline makes one per chunk of local experts (ep/chunks.py), over the chunk's rows."""

    def __init__(self, hidden, topk_ids, w_up, w_down, spec, config=None, up_bias: bool = False):
        """``topk_ids``: the [T, K] ids, or just their shape (a tuple); ``config``: run with this config
        instead of the one current_config picks for these shapes; ``up_bias``: the up projection has a bias."""
        from . import reference
        from .triton_gemm import ACTIVATIONS, GATED

        self.num_tokens, self.top_k = topk_ids if isinstance(topk_ids, tuple) else topk_ids.shape
        self.num_slots = self.num_tokens * self.top_k
        self.num_experts = w_up.shape[0]
        self.up_eff = reference.effective_weight(w_up, spec.up_layout)        # [E, H, up_width]
        self.down_eff = reference.effective_weight(w_down, spec.down_layout)  # [E, I, H]
        self.hidden_size = self.up_eff.shape[1]
        self.up_width = self.up_eff.shape[2]
        self.inter = self.down_eff.shape[1]
        kind, self.act_params, split = _gate_plan(spec.gate)
        self.act, self.act_kind = ACTIVATIONS[kind], kind
        self.gated = kind in GATED
        # Column j of the activation reads gate column j*COL_MULT and up column j*COL_MULT + UP_SHIFT.
        self.col_mult, self.up_shift = (2, 1) if split == "interleave" else (1, self.inter)
        self.interpret = hidden.device.type != "cuda"
        self.dot_precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
        self.config = config if config is not None else config_mod.current_config(
            self.num_slots, self.num_experts, self.hidden_size, self.inter, self.interpret, dtype=hidden.dtype,
            device=hidden.device)
        self.block_e = max(16, config_mod.next_pow2(self.num_experts))
        # config.gated_epilogue: the saved up projection h holds gate column j at 2j and up column j at 2j + 1
        self.h_interleaved = _interleaves_h(self, hidden, spec, up_bias)
        self._offsets_i32 = None
        self._host_bounds = None  # (offsets, [0, each expert's end row]) for the per_expert_mm GEMMs
        self._cu_seqlens = self._token_rows = None  # QuACK's group bounds and gather index, by cu_seqlens/token_rows

    def weight_halves(self) -> dict:
        """How the up weight pairs its columns (gate j with up j), as the up projection's GLU epilogue takes it."""
        return dict(two_halves=self.gated, col_mult=self.col_mult if self.gated else 1, up_shift=self.up_shift)

    def h_halves(self) -> dict:
        """How the saved up projection h pairs its columns, as the activation passes take it: the weight's split,
        or gate and up interleaved under config.gated_epilogue."""
        if self.h_interleaved:
            return dict(two_halves=True, col_mult=2, up_shift=1)
        return self.weight_halves()

    def host_bounds(self, offsets):
        """[0, expert 0's end row, ..., expert E-1's end row] of ``offsets`` on the host, for the GEMMs that run one
        matmul per expert: read once a call (the op's one host synchronization), or given by set_host_bounds.
        None while the current stream is being captured into a CUDA graph (no synchronization possible) and inside
        device_counts_only (the EP layer's device plan)."""
        if self._host_bounds is not None and self._host_bounds[0] is offsets:
            return self._host_bounds[1]
        if getattr(_DEVICE_COUNTS_ONLY, "depth", 0) or (offsets.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        self._host_bounds = (offsets, [0, *offsets.tolist()])
        return self._host_bounds[1]

    def set_host_bounds(self, offsets, ends):
        """The host's copy of ``offsets`` (each expert's end row), where the caller has it (the EP layout)."""
        self._host_bounds = (offsets, [0, *ends])

    def cu_seqlens(self, offsets, lead: bool = False):
        """[0, each expert's end row] as int32: the group bounds QuACK's variable-length GEMMs take; once a call.
        ``lead`` (rows_gemm's): ``offsets`` is a view past the first element of a longer offsets tensor, and the
        bounds start at the element before it (the first expert's first row) instead of 0."""
        if self._cu_seqlens is None or self._cu_seqlens[0] is not offsets or self._cu_seqlens[2] != lead:
            from .triton_routing import int32_index

            if lead:
                bounds = int32_index(_with_lead(offsets))
            else:
                bounds = int32_index(offsets, lead_zero=True)
            self._cu_seqlens = (offsets, bounds, lead)
        return self._cu_seqlens[1]

    def token_rows(self, row_order):
        """The token of each expert-sorted row (row_order // top_k) as int32: QuACK's gather index; once a call."""
        if self._token_rows is None or self._token_rows[0] is not row_order:
            from .triton_routing import int32_index

            self._token_rows = (row_order, int32_index(row_order, self.top_k))
        return self._token_rows[1]

    def offsets_i32(self, offsets):
        """``offsets`` (each expert's end row) as torch._grouped_mm takes them: int32, converted once a call."""
        if self._offsets_i32 is None or self._offsets_i32[0] is not offsets:
            self._offsets_i32 = (offsets, offsets.to(torch.int32))
        return self._offsets_i32[1]


# Triton's interpreter (CPU tests) stores h in the weight's split unless a test asks for config.gated_epilogue's
# interleaved layout: QuACK's gated GEMM does not run there, and its stand-in (the knob-off GEMM and activation, h
# interleaved after) gives the knob-off bits, which is what such a test checks.
INTERLEAVED_H_INTERPRETED = False


def _interleaves_h(layer: Layer, hidden, spec, up_bias: bool) -> bool:
    """config.gated_epilogue's layout of h applies: the knob on with an up config that QuACK's gated GEMM takes
    (``cfg.gated_up()``, a numerics value: a tuned config cannot change it), SwiGLU (silu(gate) * up, no clamp) over
    [gate; up] halves, no up bias, a K-contiguous up weight ([E, 2I, H], as HF stores it) and a QuACK installed that
    has the gated GEMM and runs here (bf16, Hopper) -- or, in the interpreter, a test asking for it. Decided from what
    a forward and its backward see alike (not from a QuACK failure in between, nor from a scheduling knob), so both
    read one layout; the knob itself is read by both (config.py: set it before a step)."""
    cfg = layer.config
    if not cfg.gated_epilogue or up_bias or not layer.gated or layer.col_mult != 1 \
            or layer.act_kind != "silu_glu" or any(layer.act_params):
        return False
    if layer.interpret:
        return INTERLEAVED_H_INTERPRETED
    from . import quack_gemm

    return (cfg.gated_up() and hidden.dtype == torch.bfloat16 and layer.up_eff.stride(1) == 1
            and quack_gemm.installed_reason(hidden.device) is None and quack_gemm._gated_entry() is not None)


def _interleave(h, out):
    """out [rows, 2I] (gate j at 2j, up j at 2j + 1) from h [rows, 2I] in [gate; up] halves."""
    rows, width = h.shape
    out.view(rows, width // 2, 2).copy_(h.view(rows, 2, width // 2).transpose(1, 2))
    return out


def _deinterleave(h):
    """h [rows, 2I] with gate and up interleaved, as a new tensor in [gate; up] halves."""
    rows, width = h.shape
    return h.view(rows, width // 2, 2).transpose(1, 2).reshape(rows, width)


def _warn_interleaved_fallback(what: str) -> None:
    warn_once("interleaved_h", what, "uniep: config.gated_epilogue: %s; it runs on a copy in the weight's [gate; up] "
              "halves (the knob-off GEMM's bits)", level=logging.INFO)


def _grid(upper: int, cfg) -> int:
    return max(1, min(upper, cfg.num_programs) if cfg.num_programs else upper)


# torch._grouped_mm on CPU (Triton's interpreter) rounds differently from the interpreter's numpy dots, so
# there the grouped_mm knob runs Triton unless a test asks for it (to check its plumbing, within tolerance).
GROUPED_MM_INTERPRETED = False
GROUPED_MM_MAX_GROUPS = 1023  # CUTLASS's grouped GEMM in torch takes fewer than 1024 groups


@functools.lru_cache(maxsize=16)
def _grouped_mm_gpu(device) -> bool:
    """A Hopper GPU: torch._grouped_mm's CUTLASS path there gives the Triton GEMMs' bits (config.py)."""
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device)[0] == 9


def _grouped_mm_operand(t) -> bool:
    """torch._grouped_mm takes ``t``: a 16-byte aligned base, one unit stride among the last two dimensions and
    the other (and a 3-D tensor's group stride) a multiple of 16 bytes: a TMA-ready 2-D view either way round."""
    rows, cols = t.stride(-2), t.stride(-1)
    if t.dim() == 3 and (t.stride(0) * t.element_size()) % 16:
        return False
    return ((_tma_2d(t, 1, rows, cols) and rows >= t.shape[-1])
            or (_tma_2d(t, 1, cols, rows) and cols >= t.shape[-2]))


def _use_grouped_mm(layer: Layer, cfg, out_cols: int, *operands) -> bool:
    """Run this GEMM as torch._grouped_mm (``cfg.grouped_mm``; see config.py for where that keeps the bits)?
    ``out_cols``: the output's last dimension, which must keep the output contiguous."""
    if not cfg.grouped_mm or layer.num_slots == 0 or layer.num_experts > GROUPED_MM_MAX_GROUPS:
        return False
    a = operands[0]
    if a.device.type == "cuda":
        if a.dtype != torch.bfloat16 or not _grouped_mm_gpu(a.device):
            return False
    elif not (layer.interpret and GROUPED_MM_INTERPRETED and hasattr(torch, "_grouped_mm")):
        return False
    return (out_cols % (16 // a.element_size()) == 0 and all(t.dtype == a.dtype for t in operands)
            and all(_grouped_mm_operand(t) for t in operands))


# Triton's interpreter (CPU tests) keeps its own GEMMs unless a test asks for the per-expert torch.mm path (whose
# CPU rounding differs from the interpreter's numpy dots), as for GROUPED_MM_INTERPRETED.
PER_EXPERT_MM_INTERPRETED = False
_DEVICE_COUNTS_ONLY = threading.local()  # .depth > 0 inside device_counts_only, in this thread


@contextlib.contextmanager
def device_counts_only():
    """The experts ops called inside, in this thread, read no row count on the host: their per_expert_mm GEMMs take
    the other knobs' path, as in a CUDA graph being captured. The EP layer's device plan runs its experts ops so: its
    counts stay on the device, and a read of them would be a host synchronization in the middle of its pipeline.
    Per thread: an experts op of another thread (the autograd engine runs CUDA backwards on threads of its own)
    keeps its knobs."""
    _DEVICE_COUNTS_ONLY.depth = getattr(_DEVICE_COUNTS_ONLY, "depth", 0) + 1
    try:
        yield
    finally:
        _DEVICE_COUNTS_ONLY.depth -= 1


def _per_expert_bounds(layer: Layer, cfg, offsets, *operands):
    """The host row bounds to run this GEMM as one torch.mm per expert (``cfg.per_expert_mm``; see config.py), or
    None where it does not apply: the knob off, no rows, another dtype, the interpreter, a graph being captured."""
    if not cfg.per_expert_mm or layer.num_slots == 0:
        return None
    a = operands[0]
    if a.device.type == "cuda":
        if a.dtype not in FUSED_DTYPES_GPU:
            return None
    elif not (layer.interpret and PER_EXPERT_MM_INTERPRETED):
        return None
    if any(t.dtype != a.dtype or t.device != a.device for t in operands):
        return None
    return layer.host_bounds(offsets)


def _quack_asked(layer: Layer, cfg, gather: bool) -> bool:
    """``cfg.quack`` names a config for this GEMM, that config can gather where ``gather``, and no path before it
    (per_expert_mm) or the interpreter takes the GEMM: what every QuACK GEMM needs before its operands are looked at."""
    from . import quack_gemm

    return bool(cfg.quack) and layer.num_slots > 0 and not layer.interpret and not cfg.per_expert_mm \
        and (not gather or quack_gemm.gathers(cfg.quack))


def _use_quack(layer: Layer, cfg, a, b, out=None, gather: bool = False) -> bool:
    """Run this rows GEMM (``a`` [rows or tokens, K] k-major, ``b`` [E, K, N], ``out`` [rows, N] or None) by QuACK
    (``cfg.quack``; kernels/quack_gemm.py), gathering ``a``'s rows by token where ``gather``?"""
    from . import quack_gemm

    if not _quack_asked(layer, cfg, gather):
        return False
    # QuACK's output has exactly the plan's rows (its gather index's, or A's), and B's columns
    if (not gather and a.shape[0] != layer.num_slots) or \
            (out is not None and tuple(out.shape) != (layer.num_slots, b.shape[2])):
        return False
    return (quack_gemm.usable(a.device, cfg.quack) and a.stride(-1) == 1 and (out is None or out.stride(-1) == 1)
            and quack_gemm.operands_ok(a, b, out))


def quack_gathers_rows(layer: Layer, cfg, hidden, b, bias=None) -> bool:
    """The up projection reads its token rows from ``hidden`` itself (QuACK's gather), so no gathered copy is made
    (not with a bias: QuACK's path here takes none, and the gather would then fall to the slower Triton one)."""
    return bias is None and _use_quack(layer, cfg, hidden, b, gather=True)


def rows_gemm(layer: Layer, cfg, *, a, gather, row_order, b, n, k, epilogue, c=None, d=None, w=None,
              a_scale=False, bias=None, offsets, two_halves=False, col_mult=1, up_shift=0, scatter=None,
              interleaved: bool = False, lead: bool = False):
    """The rows GEMM into ``c`` (a new [rows, width] tensor when None); returns ``c``. A GEMM with no given ``c``,
    a plain or activation epilogue, materialized rows and no bias runs as torch._grouped_mm where
    ``cfg.grouped_mm`` asks and the operands allow (the activation then by an element-wise pass into ``d``).

    Where ``cfg.per_expert_mm`` asks and the GEMM qualifies (a plain or activation epilogue, materialized rows, no
    bias, no scatter; ``c`` may be given), it runs as one torch.mm per expert instead, before either of those; next,
    where ``cfg.quack`` names a config and QuACK runs (_use_quack), by QuACK, gathered rows and a given ``c``
    included.

    ``scatter`` (a STORE epilogue only): (dst, peers), the EP layer's push fused into the GEMM: row r goes to row
    dst[r] >> 3 of peers[dst[r] & 7] ([*, n] buffers of one dtype, at most MAX_PEERS), by Triton; returns None.

    ``interleaved`` (config.gated_epilogue's layout, Layer.h_interleaved): with the GLU_FWD epilogue, h is stored
    with gate and up columns interleaved (``c`` [rows, 2I]) and the activation comes from QuACK's gated GEMM; with
    STORE, ``a``'s K columns are interleaved against ``b``'s [gate; up] K rows (the input gradient from d_h).

    ``lead``: ``offsets`` is a view of a longer offsets tensor past its first element, whose element before the view
    is the first expert's first row (a run of experts [e0, e1) of a buffer in expert order, with ``b`` and ``bias``
    their slices; the EP device plan's pipeline): by QuACK where ``cfg.quack`` asks and it runs (its group bounds
    taken from that element on), else by Triton; torch._grouped_mm's group bounds start at row 0 and per_expert_mm
    reads them on the host, so neither may be asked. Only the run's rows of ``c`` and ``d`` are written."""
    from .triton_gemm import GLU_FWD, STORE
    from .triton_gemm import _rows_gemm as kernel

    if lead:
        if interleaved or cfg.per_expert_mm or cfg.grouped_mm:
            raise ValueError("uniep: a GEMM over a run of experts that starts past row 0 (lead) runs by QuACK or "
                             "Triton only, over h in halves")
        _with_lead(offsets)  # the caller's contract, checked before any path reads the element before ``offsets``
    if interleaved:
        return _rows_gemm_interleaved(layer, cfg, a=a, gather=gather, row_order=row_order, b=b, n=n, k=k,
                                      epilogue=epilogue, c=c, d=d, w=w, a_scale=a_scale, bias=bias, offsets=offsets,
                                      two_halves=two_halves, col_mult=col_mult, up_shift=up_shift, scatter=scatter)

    width = b.shape[2] if epilogue == GLU_FWD else n
    peers = []
    if scatter is not None:
        from .triton_transfer import MAX_PEERS

        dst, peers = scatter
        if epilogue != STORE or c is not None or not 0 < len(peers) <= MAX_PEERS or dst.shape[0] != layer.num_slots:
            raise ValueError("uniep: a scattered GEMM takes a STORE epilogue, no output and a row table, "
                             f"for 1 to {MAX_PEERS} peers")
        c = peers[0]
        counters["uniep_kernels"]["scattered_gemms"] += 1
    plain = epilogue in (STORE, GLU_FWD) and not gather and not a_scale and bias is None
    bounds = _per_expert_bounds(layer, cfg, offsets, a, b) if plain and scatter is None else None
    if bounds is not None:  # one cuBLAS matmul per expert, into its rows of c
        counters["uniep_kernels"]["per_expert_mm_gemms"] += 1
        if c is None:
            c = torch.empty(layer.num_slots, width, dtype=b.dtype, device=a.device)
        for e in range(layer.num_experts):
            lo, hi = bounds[e], bounds[e + 1]
            if hi > lo:
                torch.mm(a[lo:hi], b[e], out=c[lo:hi])
        if epilogue == GLU_FWD:
            _act_forward(layer, up=c, act=d, offsets=offsets, two_halves=two_halves, col_mult=col_mult,
                         up_shift=up_shift)
        return c
    if scatter is None and epilogue in (STORE, GLU_FWD) and not a_scale and bias is None and width == b.shape[2] \
            and _use_quack(layer, cfg, a, b, c, gather):
        from . import quack_gemm

        out = c if c is not None else torch.empty(layer.num_slots, width, dtype=b.dtype, device=a.device)
        try:
            quack_gemm.rows(a, b, out, layer.cu_seqlens(offsets, lead), cfg.quack,
                            a_idx=layer.token_rows(row_order) if gather else None)
        except Exception as exc:  # noqa: BLE001 -- a QuACK call that raises: the knob goes off, the other path runs
            quack_gemm.failed(exc)
        else:
            counters["uniep_kernels"]["quack_gemms"] += 1
            if epilogue == GLU_FWD:
                _act_forward(layer, up=out, act=d, offsets=offsets, two_halves=two_halves, col_mult=col_mult,
                             up_shift=up_shift, lead=lead)
            return out
    if c is None and plain and _use_grouped_mm(layer, cfg, width, a, b):
        counters["uniep_kernels"]["grouped_mm_gemms"] += 1
        c = torch._grouped_mm(a, b, offs=layer.offsets_i32(offsets))
        if epilogue == GLU_FWD:
            _act_forward(layer, up=c, act=d, offsets=offsets, two_halves=two_halves, col_mult=col_mult,
                         up_shift=up_shift)
        return c
    if c is None:
        c = torch.empty(layer.num_slots, width, dtype=b.dtype, device=a.device)
    cfg.validate(layer.interpret)
    upper = (_cdiv(layer.num_slots, cfg.block_m) + layer.num_experts) * _cdiv(n, cfg.block_n)
    grid = _grid(upper, cfg)
    d = d if d is not None else c
    a_desc = b_desc = None
    b_kmajor, b_expert_rows = False, 0
    packed = two_halves and epilogue == GLU_FWD and layer.config.pack_gate_up
    if layer.config.tma and k % cfg.block_k == 0 and _tma_device(a.device):
        from triton.tools.tensor_descriptor import TensorDescriptor

        if not gather and _tma_2d(a, a.shape[0], a.stride(0), a.stride(1)):
            a_desc = TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1], [cfg.block_m, cfg.block_k])
        e, kb, nb = b.shape
        # The packed gate|up weight tile takes two column blocks of one weight; it keeps pointer loads
        # (measured: two accumulators cost the up projection more than the copies gain).
        if col_mult == 1 and not packed and cfg.block_n <= 256 and cfg.block_k <= 256:
            if _tma_2d(b, e * kb, b.stride(1), b.stride(2)) and b.stride(0) == kb * b.stride(1):
                b_desc = TensorDescriptor(b, [e * kb, nb], [b.stride(1), 1], [cfg.block_k, cfg.block_n])
                b_expert_rows = kb
            elif _tma_2d(b, e * nb, b.stride(2), b.stride(1)) and b.stride(0) == nb * b.stride(2) and \
                    (not layer.interpret or TMA_KMAJOR_INTERPRETED):
                b_desc = TensorDescriptor(b, [e * nb, kb], [b.stride(2), 1], [cfg.block_n, cfg.block_k])
                b_kmajor, b_expert_rows = True, nb
    if row_order is None:  # read only to gather rows
        assert not gather
        row_order = offsets
    launch(kernel, (grid,),
        a, a.stride(0), a.stride(1), row_order, layer.top_k,
        b, b.stride(0), b.stride(1), b.stride(2),
        bias if bias is not None else c, bias.stride(0) if bias is not None else 0,
        offsets, layer.num_experts, n, k,
        c, c.stride(0), d, d.stride(0), w if w is not None else c,
        up_shift, COL_MULT=col_mult, act_alpha=layer.act_params[0], act_limit=layer.act_params[1],
        act_up_add=layer.act_params[2],
        GATHER=gather, A_SCALE=a_scale, EPILOGUE=epilogue, ACT=layer.act, TWO_HALVES=two_halves,
        TWO_ACC=two_halves and epilogue == GLU_FWD and not packed,
        PACKED=packed, HAS_BIAS=bias is not None,
        DOT_PRECISION=layer.dot_precision, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=layer.block_e,
        GROUP_M=cfg.group_m, num_programs=grid,
        a_desc=a_desc, b_desc=b_desc, b_expert_rows=b_expert_rows,
        TMA_A=a_desc is not None, TMA_B=b_desc is not None, B_KMAJOR=b_kmajor,
        FLATTEN=cfg.flatten, WARP_SPEC=cfg.warp_specialize,
        **({"dst_ptr": scatter[0], "SCATTER": True,
            **{f"q{i}": peers[min(i, len(peers) - 1)] for i in range(MAX_PEERS)}} if scatter is not None else {}),
        LEAD=lead, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return c if scatter is None else None


def _rows_gemm_interleaved(layer: Layer, cfg, *, a, gather, row_order, b, epilogue, c, d, offsets, scatter, **rest):
    """rows_gemm with ``interleaved``: by QuACK where it runs (the gated GEMM, or the GEMM reading b's halves
    interleaved), else the same GEMM over the weight's halves and a copy between the layouts."""
    from . import quack_gemm
    from .triton_gemm import GLU_FWD

    width = b.shape[2] if epilogue == GLU_FWD else rest["n"]
    if epilogue == GLU_FWD:
        out = c if c is not None else torch.empty(layer.num_slots, width, dtype=b.dtype, device=a.device)
        if scatter is None and d is not None and rest["bias"] is None and not rest["a_scale"] \
                and d.is_contiguous() and _use_quack(layer, cfg, a, b, out, gather):
            try:
                quack_gemm.gated(a, b, out, d, layer.cu_seqlens(offsets), cfg.quack,
                                 a_idx=layer.token_rows(row_order) if gather else None)
            except Exception as exc:  # noqa: BLE001 -- the knob-off GEMM and activation, h interleaved after
                quack_gemm.failed(exc)
            else:
                counters["uniep_kernels"]["quack_gemms"] += 1
                return out
        _warn_interleaved_fallback("QuACK's gated GEMM does not run this up projection")
        h = rows_gemm(layer, cfg, a=a, gather=gather, row_order=row_order, b=b, epilogue=epilogue, d=d,
                      offsets=offsets, scatter=scatter, **rest)
        return _interleave(h, out)
    if scatter is None and not gather and not rest["a_scale"] and rest["bias"] is None and b.stride(2) == 1 \
            and _use_quack(layer, cfg, a, b, c, False):
        out = c if c is not None else torch.empty(layer.num_slots, width, dtype=b.dtype, device=a.device)
        try:
            quack_gemm.rows(a, b, out, layer.cu_seqlens(offsets), cfg.quack, concat=True)
        except Exception as exc:  # noqa: BLE001 -- the copy in halves below
            quack_gemm.failed(exc)
        else:
            counters["uniep_kernels"]["quack_gemms"] += 1
            return out
    _warn_interleaved_fallback("a GEMM reading interleaved rows does not run by QuACK")
    return rows_gemm(layer, cfg, a=_deinterleave(a), gather=gather, row_order=row_order, b=b, epilogue=epilogue,
                     c=c, d=d, offsets=offsets, scatter=scatter, **rest)


# Weight tiles stored K-major ([E, out, in] up projection, for one) are loaded [block_n, block_k] and
# transposed in the kernel. Triton's interpreter multiplies that transposed view with numpy, whose
# matmul rounds a transposed operand differently from a contiguous one, so on CPU the results would
# differ in the last bits from the pointer loads' (the GPU's MMAs do not care: tests/test_gpu_megakernel.py
# holds the bits there). The interpreter therefore keeps pointer loads for them unless a test asks.
TMA_KMAJOR_INTERPRETED = False


@functools.lru_cache(maxsize=16)
def _tma_device(device) -> bool:
    """Bulk tensor copies: Hopper or newer (or the interpreter), and a Triton with tensor descriptors."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    if device.type != "cuda":
        return True  # Triton's interpreter emulates the copies (CPU tests)
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_2d(t, rows: int, row_stride: int, col_stride: int) -> bool:
    """Can a 2-D tensor descriptor with this row stride (elements) and unit column stride cover ``t``'s
    storage from its first element? Base and row stride 16-byte aligned, at least one row."""
    size = t.element_size()
    return (col_stride == 1 and rows > 0 and t.data_ptr() % 16 == 0 and (row_stride * size) % 16 == 0
            and row_stride > 0)


def _act_pass(layer: Layer, kernel, tensors, *, offsets, two_halves, col_mult, up_shift, **lead):
    """Launch an element-wise activation kernel of triton_gemm.py over the routed rows and the activation's
    columns; ``tensors`` are its leading (tensor, row stride) arguments. ``lead``: _act_forward's LEAD (the rows
    from the element before ``offsets``: rows_gemm's ``lead``), which the other activation kernels do not take."""
    block_r, block_c = (16, 32) if layer.interpret else (16, 256)
    grid = (_cdiv(max(layer.num_slots, 1), block_r), _cdiv(layer.inter, block_c))
    launch(kernel, grid, *(x for t in tensors for x in (t, t.stride(0))), offsets, layer.num_experts, layer.inter,
           up_shift, COL_MULT=col_mult, TWO_HALVES=two_halves, ACT=layer.act, act_alpha=layer.act_params[0],
           act_limit=layer.act_params[1], act_up_add=layer.act_params[2], BLOCK_R=block_r, BLOCK_C=block_c,
           num_warps=4, **lead)


def _act_forward(layer: Layer, *, up, act, lead: bool = False, **halves):
    """act(h) into ``act`` over the routed rows (from the element before ``offsets`` where ``lead``)."""
    from .triton_gemm import _act_forward as kernel

    _act_pass(layer, kernel, (up, act), **halves, LEAD=lead)


def _with_lead(offsets):
    """``offsets`` (a 1-D view past the first element of a longer tensor) with the element before it."""
    if offsets.dim() != 1 or offsets.storage_offset() < offsets.stride(0):
        raise ValueError("uniep: a lead GEMM's offsets must be a view past the first element of their tensor")
    return offsets.as_strided((offsets.shape[0] + 1,), offsets.stride(), offsets.storage_offset() - offsets.stride(0))


def act_backward(layer: Layer, *, d_act, up, d_up, act=None, **halves):
    """d_up from d_act and the saved up projection; act(h) into ``act`` (None: over d_act, in place). ``halves``:
    offsets, two_halves, col_mult, up_shift, as rows_gemm takes them."""
    from .triton_gemm import _act_backward as kernel

    _act_pass(layer, kernel, (d_act, up, d_up, act if act is not None else d_act), **halves)


# (rows, columns, warps) of act_backward_late_weight's tiles on a GPU. The column tile sets how the routing-weight
# gradient's sum over a row is split, so it is fixed, not a tuner knob. On an H200 (bf16, T = 8192,
# benchmarks/probes/act_pass_probe.py) the pass took 0.205 / 0.248 ms on Qwen3-30B-A3B / OLMoE at 16x128x4 and
# 8x256x4, 0.255 / 0.306 at 16x256x4, against 0.187 + 0.129 / 0.225 + 0.123 for the knob-off activation backward
# and routing-weight gradient it replaces.
LATE_ACT_TILE = (16, 128, 4)


def act_backward_late_weight(layer: Layer, *, d_raw, up, d_up, row_order, weights, d_weights, offsets, two_halves,
                             col_mult, up_shift):
    """config.late_routing_weight's activation backward: d_up from the routing weights and the activation-gradient
    GEMM's output over the unweighted output-gradient rows (``d_raw``, which then holds w * act(h)), and into
    ``d_weights`` ([T, K]) the routing weights' gradient (triton_gemm._act_backward_late_weight, then
    _sum_weight_grad_parts over its column tiles' parts)."""
    from .triton_gemm import _act_backward_late_weight as kernel
    from .triton_gemm import _sum_weight_grad_parts

    block_r, block_c, warps = (16, 32, 4) if layer.interpret else LATE_ACT_TILE
    rows = layer.num_slots
    grid = (_cdiv(max(rows, 1), block_r), _cdiv(layer.inter, block_c))
    parts = torch.empty(grid[1], rows, dtype=torch.float32, device=d_raw.device)
    launch(kernel, grid, d_raw, d_raw.stride(0), up, up.stride(0), d_up, d_up.stride(0), row_order, weights, parts,
           offsets, layer.num_experts, rows, layer.inter, up_shift, COL_MULT=col_mult, TWO_HALVES=two_halves,
           ACT=layer.act, act_alpha=layer.act_params[0], act_limit=layer.act_params[1],
           act_up_add=layer.act_params[2], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    if rows:
        launch(_sum_weight_grad_parts, (_cdiv(rows, 1024),), parts, row_order, d_weights, rows, grid[1],
               BLOCK_R=1024, num_warps=4)


def _quack_wgrad_operands(layer: Layer, cfg, p, q, p_gather: bool, m_dim: int):
    """(A^T [M, rows] m-major, B [rows, N], whether the gradient is written through its transpose) to run this
    weight gradient by QuACK (``cfg.quack``), gathering P's rows by token where ``p_gather``; None where it cannot.
    QuACK gathers only its A operand, so a gathered P whose columns come second in the gradient ([E, Q's, P's]
    columns: HF's [out, in] weights) is written through the gradient's transposed (m-major) view."""
    from . import quack_gemm

    if not _quack_asked(layer, cfg, p_gather):
        return None
    if m_dim == 1:
        a_t, b, transposed = p.t(), q, False
    elif not p_gather:
        a_t, b, transposed = q.t(), p, False
    else:
        a_t, b, transposed = p.t(), q, True
    if not (quack_gemm.usable(p.device, cfg.quack) and a_t.stride(-2) == 1 and b.stride(-1) == 1
            and quack_gemm.operands_ok(a_t, b)):
        return None
    return a_t, b, transposed


def quack_gathers_weight_rows(layer: Layer, cfg, hidden, d_up, m_dim: int, bias_grad=None) -> bool:
    """The up projection's weight gradient reads its token rows from ``hidden`` itself (QuACK's gather; not with a bias
    gradient, which QuACK's path here does not compute)."""
    return bias_grad is None and _quack_wgrad_operands(layer, cfg, hidden, d_up, True, m_dim) is not None


def weight_grad(layer: Layer, cfg, *, p, p_gather, q, q_gather, q_scale, row_order, w, offsets, grad, m_dim,
                n_dim, bias_grad=None, q_interleaved: bool = False):
    """grad[e] (a weight-shaped tensor, indexed through dims m_dim, n_dim) = P_e^T @ Q_e; returns grad. ``grad``
    may be a shape: the gradient is then a new contiguous tensor of P's dtype, computed by torch._grouped_mm
    where ``cfg.grouped_mm`` asks and the operands allow (materialized, unscaled rows, no bias gradient).
    ``q_interleaved``: Q's columns are config.gated_epilogue's interleaved d_h, the gradient's n_dim the weight's
    [gate; up] halves: QuACK writes them in place where it runs, else the GEMM reads a copy of Q in halves (the
    same products summed in the same order: the same bits)."""
    from .triton_gemm import _weight_grad_gemm as kernel

    if q_interleaved:
        done = _weight_grad_interleaved(layer, cfg, p=p, p_gather=p_gather, q=q, q_gather=q_gather, q_scale=q_scale,
                                        row_order=row_order, offsets=offsets, grad=grad, m_dim=m_dim,
                                        bias_grad=bias_grad)
        if done is not None:
            return done
        _warn_interleaved_fallback("a weight gradient of interleaved rows does not run by QuACK")
        q = _deinterleave(q)

    # [E, M, N] = per expert P^T Q over its rows, or [E, N, M] = Q^T P: the same products summed over the
    # same rows in the same order
    a, b = (p, q) if m_dim == 1 else (q, p)
    bounds = _per_expert_bounds(layer, cfg, offsets, p, q) \
        if not (p_gather or q_gather or q_scale) and bias_grad is None else None
    if bounds is not None:  # one cuBLAS matmul per expert, into its slice of the gradient
        counters["uniep_kernels"]["per_expert_mm_gemms"] += 1
        if not isinstance(grad, torch.Tensor):
            grad = torch.empty(tuple(grad), dtype=p.dtype, device=p.device)
        for e in range(layer.num_experts):
            lo, hi = bounds[e], bounds[e + 1]
            if hi > lo:  # grad[e]: [a's columns, b's columns] (grad's dims m_dim, n_dim name P's and Q's)
                torch.mm(a[lo:hi].t(), b[lo:hi], out=grad[e])
            else:  # an expert without rows
                grad[e].zero_()
        return grad
    quack = _quack_wgrad_operands(layer, cfg, p, q, p_gather, m_dim) \
        if not isinstance(grad, torch.Tensor) and not (q_gather or q_scale) and bias_grad is None else None
    if quack is not None:
        from . import quack_gemm

        a_t, b_rows, transposed = quack
        out = torch.empty(tuple(grad), dtype=p.dtype, device=p.device)
        try:
            quack_gemm.wgrad(a_t, b_rows, out.transpose(1, 2) if transposed else out, layer.cu_seqlens(offsets),
                             cfg.quack, a_idx=layer.token_rows(row_order) if p_gather else None)
        except Exception as exc:  # noqa: BLE001 -- a QuACK call that raises: the knob goes off, the other path runs
            quack_gemm.failed(exc)
        else:
            counters["uniep_kernels"]["quack_gemms"] += 1
            return out
    if not isinstance(grad, torch.Tensor):
        shape = tuple(grad)
        if not (p_gather or q_gather or q_scale) and bias_grad is None and \
                _use_grouped_mm(layer, cfg, shape[2], a.t(), b):
            counters["uniep_kernels"]["grouped_mm_gemms"] += 1
            return torch._grouped_mm(a.t(), b, offs=layer.offsets_i32(offsets))
        grad = torch.empty(shape, dtype=p.dtype, device=p.device)
    cfg.validate(layer.interpret)
    m, n = grad.shape[m_dim], grad.shape[n_dim]
    upper = layer.num_experts * _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    grid = _grid(upper, cfg)
    p_desc = q_desc = None
    if (layer.config.tma_weight_grad and not (p_gather or q_gather or q_scale) and _tma_device(p.device)
            and max(cfg.block_m, cfg.block_n, cfg.block_k) <= 256
            and _tma_2d(p, p.shape[0], p.stride(0), p.stride(1)) and _tma_2d(q, q.shape[0], q.stride(0), q.stride(1))):
        from triton.tools.tensor_descriptor import TensorDescriptor

        p_desc = TensorDescriptor(p, [p.shape[0], m], [p.stride(0), 1], [cfg.block_k, cfg.block_m])
        q_desc = TensorDescriptor(q, [q.shape[0], n], [q.stride(0), 1], [cfg.block_k, cfg.block_n])
    if row_order is None:  # read only to gather rows
        assert not (p_gather or q_gather or q_scale)
        row_order = offsets
    launch(kernel, (grid,),
        p, p.stride(0), p.stride(1), q, q.stride(0), q.stride(1), row_order, w if w is not None else q, layer.top_k,
        offsets, layer.num_experts, m, n,
        grad, grad.stride(0), grad.stride(m_dim), grad.stride(n_dim),
        bias_grad if bias_grad is not None else grad, bias_grad.stride(0) if bias_grad is not None else 0,
        P_GATHER=p_gather, Q_GATHER=q_gather, Q_SCALE=q_scale, HAS_BIAS=bias_grad is not None,
        DOT_PRECISION=layer.dot_precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_programs=grid, p_desc=p_desc, q_desc=q_desc, TMA=p_desc is not None,
        FLATTEN=cfg.flatten, WARP_SPEC=cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return grad


# The storages of the saved `up` and `down` buffers an in-place backward has overwritten. Keyed by the storage
# (its StorageImpl, not its data pointer); the weak reference held here keeps that key from being reused by
# another storage while it is listed, and a storage nothing else holds any more is dropped on the next call.
_OVERWRITTEN: dict = {}


def claim_saved_buffers(up, down, error: str) -> None:
    """Record that an in-place backward overwrites `up` and `down`; raise RuntimeError(error) if one did so already
    (the same saved tensors handed to a second backward). Called by overwriting_saved_buffers where the buffers are
    handed to experts_backward(reuse_saved=True): the in-place experts op (ops.py), which the eager autograd formula
    and AOTAutograd's compiled backward both call, and the EP exchange's backward, which calls that backward itself."""
    from torch.multiprocessing.reductions import StorageWeakRef

    for key in [key for key, ref in _OVERWRITTEN.items() if ref.expired()]:
        del _OVERWRITTEN[key]
    refs = [StorageWeakRef(t.untyped_storage()) for t in (up, down)]
    if any(ref.cdata in _OVERWRITTEN for ref in refs):
        raise RuntimeError(error)
    _OVERWRITTEN.update((ref.cdata, ref) for ref in refs)


@contextlib.contextmanager
def overwriting_saved_buffers(up, down, error: str):
    """The block that hands `up` and `down` to an in-place backward: claim_saved_buffers first, then their version
    counters kept as they were. The in-place writes would bump them, and autograd would then refuse a second backward
    before the claim could say why: the claim stands in for the counters."""
    claim_saved_buffers(up, down, error)
    with torch.autograd._unsafe_preserve_version_counter((up, down)):
        yield


def experts_forward(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec, plan=None, config=None):
    """Same contract as reference.experts_forward (without post programs); `plan` is the routing plan
    of topk_ids when the router op computed it already; `config`: run with this config instead of the one
    config.current_config picks (op_graphs.py captures with the config of its key)."""
    from .triton_gemm import GLU_FWD, STORE
    from .triton_routing import combine, gather_rows, routing_plan

    counters["uniep_kernels"]["triton_forward"] += 1
    layer = Layer(hidden, topk_ids, w_up, w_down, spec, config=config, up_bias=b_up is not None)
    cfg = layer.config
    row_order, slot_row, offsets = plan if plan is not None else \
        routing_plan(topk_ids, layer.num_experts, clamp=spec.out_of_range == "clamp")
    device = hidden.device
    if layer.num_slots:
        act = torch.empty(layer.num_slots, layer.inter, dtype=w_down.dtype, device=device)
        gather = cfg.fuse_gather or quack_gathers_rows(layer, cfg.up, hidden, layer.up_eff, b_up)
        x = hidden if gather else gather_rows(hidden, row_order, layer.top_k, offsets=offsets)
        up = rows_gemm(layer, cfg.up, a=x, gather=gather, row_order=row_order, b=layer.up_eff, n=layer.inter,
                       k=layer.hidden_size, epilogue=GLU_FWD, d=act, bias=b_up, offsets=offsets,
                       interleaved=layer.h_interleaved, **layer.weight_halves())
        del x
        down = rows_gemm(layer, cfg.down, a=act, gather=False, row_order=row_order, b=layer.down_eff,
                         n=layer.hidden_size, k=layer.inter, epilogue=STORE, bias=b_down, offsets=offsets)
        del act
    else:
        up = torch.empty(0, layer.up_width, dtype=w_up.dtype, device=device)
        down = torch.empty(0, layer.hidden_size, dtype=w_down.dtype, device=device)
    record_h_layout(up, layer.h_interleaved)
    out = combine(down, slot_row, topk_weights.reshape(layer.num_tokens, layer.top_k), offsets, layer.num_tokens,
                  layer.top_k, spec.out_dtype)
    return out, row_order, slot_row, offsets, up, down


# The layout each forward stored its up projection h in (config.gated_epilogue), by h's address; the backward checks
# its own decision against it. The last _H_LAYOUTS_KEPT forwards' are kept: an address comes back with a later h,
# whose forward writes its own entry, so an entry is always that of the forward that wrote the h now there.
_H_LAYOUTS: dict = {}
_H_LAYOUTS_KEPT = 4096


def record_h_layout(up, interleaved: bool) -> None:
    """``up`` holds a saved h in this layout (the forwards that write one: experts_forward, the EP layers' chunks
    and the device plan's pipeline)."""
    if up.numel():
        _H_LAYOUTS.pop(up.data_ptr(), None)  # re-inserted last: the oldest entry is the first one
        _H_LAYOUTS[up.data_ptr()] = interleaved
        if len(_H_LAYOUTS) > _H_LAYOUTS_KEPT:
            del _H_LAYOUTS[next(iter(_H_LAYOUTS))]


def copy_h_layout(source, copy) -> None:
    """``copy`` (of ``source``'s first rows) holds a saved h in the layout its forward stored ``source`` in."""
    stored = _H_LAYOUTS.get(source.data_ptr()) if source.numel() else None
    if stored is not None:
        record_h_layout(copy, stored)


def check_h_layout(up, interleaved: bool) -> None:
    """Refuse a backward that would read the saved h in another layout than its forward stored: the gated_epilogue
    knob (UNIEP_GATED_EPILOGUE, use_config) changed between them. Gradients would be silently wrong otherwise."""
    stored = _H_LAYOUTS.get(up.data_ptr()) if up.numel() else None
    if stored is not None and stored != interleaved:
        raise RuntimeError(
            "uniep: this experts layer's forward stored its up projection with gate and up "
            f"{'interleaved' if stored else 'in halves'} (config.gated_epilogue {'on' if stored else 'off'}), and "
            f"its backward would read it {'interleaved' if interleaved else 'in halves'}: UNIEP_GATED_EPILOGUE (or "
            "use_config) changed between the forward and the backward. Set it before the step, not inside it.")


def experts_backward(grad_out, hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down,
                     row_order, slot_row, offsets, up, down, spec, reuse_saved: bool = False,
                     weights_grad: bool = True, input_rows=None, param_grads: bool = True, down_saved: bool = True,
                     input_first=None, d_act=None):
    """Same contract as reference.experts_backward (without post programs); with ``weights_grad=False`` the
    routing-weight gradient is not computed (zeros in its place); with ``param_grads=False`` (frozen experts) the
    two weight-gradient GEMMs and the hidden rows' gather they read are not run, and the four expert-parameter
    gradients come back None (the other gradients are computed as with them, to the bit). ``down_saved=False``: the
    forward kept no ``down`` (backward_reads_down), and ``down`` is a [rows, H] buffer of no meaning, or an empty
    tensor: config.late_routing_weight's path runs, which reads none. With ``input_rows`` (a
    [rows, H] buffer of w_up's dtype) the input-gradient rows are written there and not combined: d_hidden comes
    back None, and ``combine_input_rows`` sums them later. ``grad_out`` may be a one-element list holding the caller's only
    reference (the EP exchange's received gradient rows, [rows, H]): it is emptied, and the rows are freed once
    gathered, before the GEMMs' buffers. ``input_first`` (a callable, with ``input_rows`` and without reuse_saved):
    the input-gradient GEMM runs as soon as d_up is ready, before the weight gradients, and ``input_first`` is called
    with its rows then (the EP device plan launches their pushes there, to run beside the weight-gradient GEMMs). The
    GEMMs are those of the same call without it, so are the bits. ``d_act`` ([rows, I] of w_down's dtype): the activation-gradient GEMM's
    rows, dY W_down^T of the weighted output-gradient rows, computed already (the EP device plan's pipelined backward
    runs that GEMM chunk by chunk as the rows arrive); not under late_routing_weight.

    Memory, with reuse_saved (the in-place backward op): the saved buffers are scratch once read. ``down``
    ([rows, H]) is read by the routing-weight gradient and then holds, in turn, the weighted output-gradient
    rows and the hidden rows (and, given as ``input_rows``, the input-gradient rows); ``up`` ([rows, up_width])
    becomes d_up in place (the activation backward reads h and writes d_h at the same element). The weight
    gradients come before the input gradient. The peak is then the saved tensors and the two weight gradients,
    as for autograd's op-by-op backward, provided d_hidden is allocated after ``up`` is freed: the in-place
    op leaves the combine to a second op (ops.py) for that reason."""
    from .triton_gemm import STORE
    from .triton_routing import gather_rows, routing_weight_grad

    if input_first is not None and (input_rows is None or reuse_saved):
        raise ValueError("uniep: experts_backward's input_first needs input_rows and no reuse_saved")
    counters["uniep_kernels"]["triton_backward"] += 1
    layer = Layer(hidden, topk_ids, w_up, w_down, spec, up_bias=b_up is not None)
    check_h_layout(up, layer.h_interleaved)
    cfg = layer.config
    device = hidden.device
    grad_out = (grad_out.pop() if isinstance(grad_out, list) else grad_out).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    # config.late_routing_weight (a numerics knob): the activation-gradient GEMM reads the output-gradient rows
    # unweighted, and the activation backward applies the weights and takes their gradient (no read of ``down``).
    # Not for weights that need no gradient (the EP layers' received rows, whose weights are ones): the knob would
    # save no pass there, and the weighted copy it skips is a copy of the rows as they are.
    if not down_saved and b_down is not None:
        raise ValueError("uniep: the experts' backward needs the forward's down rows where there is a down bias")
    late = (cfg.late_routing_weight or not down_saved) and b_down is None and weights_grad
    if late and d_act is not None:
        raise ValueError("uniep: experts_backward's d_act is the weighted rows' GEMM, not late_routing_weight's")
    if late or not weights_grad:
        d_weights = None
    else:
        d_weights = routing_weight_grad(grad_out, down, slot_row, offsets, layer.num_tokens, layer.top_k,
                                        topk_weights.dtype)
    d_b_up = torch.empty(b_up.shape, dtype=b_up.dtype, device=device) if b_up is not None and param_grads else None
    d_b_down = torch.empty(b_down.shape, dtype=b_down.dtype, device=device) if b_down is not None and param_grads \
        else None
    # Weight gradients in the [E, in, out] math: grad[e][i, o], i.e. dims (1, 2) for "io", (2, 1) for "oi".
    down_dims = (1, 2) if spec.down_layout == "io" else (2, 1)
    up_dims = (1, 2) if spec.up_layout == "io" else (2, 1)
    gather = cfg.fuse_gather
    scratch = down if reuse_saved and down.dtype == grad_out.dtype and down.is_contiguous() and \
        down.shape[0] == layer.num_slots else None
    d_up = up if reuse_saved and up.is_contiguous() else torch.empty(up.shape, dtype=up.dtype, device=device)
    halves = layer.h_halves()  # how the saved h (and so d_up) pairs gate and up columns
    d_w_down = d_w_up = None

    def input_grad(d_up, target):
        return rows_gemm(layer, cfg.grad_input, a=d_up, gather=False, row_order=None,
                         b=layer.up_eff.transpose(1, 2), n=layer.hidden_size, k=layer.up_width, epilogue=STORE,
                         c=target, offsets=offsets, interleaved=layer.h_interleaved)

    def early(d_up):  # d_up is ready: the input gradient first where the caller asked for it
        if input_first is not None:
            input_first(input_grad(d_up, input_rows))
    if late:
        b_act = layer.down_eff.transpose(1, 2)
        dy_gather = gather or quack_gathers_rows(layer, cfg.grad_act, grad_out, b_act)
        dy = grad_out if dy_gather else gather_rows(grad_out, row_order, layer.top_k, out=scratch, offsets=offsets)
        d_weights = torch.empty(layer.num_tokens, layer.top_k, dtype=topk_weights.dtype, device=device)
        act = _dgated_late(layer, cfg.grad_act, dy=dy, dy_gather=dy_gather, b=b_act, up=up, d_up=d_up,
                           row_order=row_order, weights=weights, d_weights=d_weights, offsets=offsets)
        if act is None:
            act = rows_gemm(layer, cfg.grad_act, a=dy, gather=dy_gather, row_order=row_order, b=b_act,
                            n=layer.inter, k=layer.hidden_size, epilogue=STORE, offsets=offsets)
            act_backward_late_weight(layer, d_raw=act, up=up, d_up=d_up, row_order=row_order, weights=weights,
                                     d_weights=d_weights, offsets=offsets, **halves)
        early(d_up)
        if param_grads:
            # dW_down[e] = dY_e^T (w * act)_e: the output-gradient rows are P here, gathered by token where the
            # GEMM can (else copied, where the activation-gradient GEMM gathered them itself)
            if dy_gather and not (gather or quack_gathers_weight_rows(layer, cfg.wgrad_down, grad_out, act,
                                                                      down_dims[1])):
                dy, dy_gather = gather_rows(grad_out, row_order, layer.top_k, out=scratch, offsets=offsets), False
            d_w_down = weight_grad(layer, cfg.wgrad_down, p=dy, p_gather=dy_gather, q=act, q_gather=False,
                                   q_scale=False, row_order=row_order, w=None, offsets=offsets, grad=w_down.shape,
                                   m_dim=down_dims[1], n_dim=down_dims[0])
        del grad_out
    else:
        dy = grad_out if gather else gather_rows(grad_out, row_order, layer.top_k, weights, out=scratch,
                                                 offsets=offsets)
        del grad_out  # read for the last time (dy is the same tensor where the GEMMs gather it themselves)
        # d_act lands (rounded, like the reference's GEMM output) in the act buffer; an element-wise pass turns it
        # into d_up and act in place.
        act = d_act if d_act is not None else rows_gemm(
            layer, cfg.grad_act, a=dy, gather=gather, a_scale=gather, row_order=row_order,
            b=layer.down_eff.transpose(1, 2), n=layer.inter, k=layer.hidden_size, epilogue=STORE, w=weights,
            offsets=offsets)
        act_backward(layer, d_act=act, up=up, d_up=d_up, offsets=offsets, **halves)
        early(d_up)
        if param_grads:
            d_w_down = weight_grad(layer, cfg.wgrad_down, p=act, p_gather=False, q=dy, q_gather=gather,
                                   q_scale=gather, row_order=row_order, w=weights, offsets=offsets, grad=w_down.shape,
                                   m_dim=down_dims[0], n_dim=down_dims[1], bias_grad=d_b_down)
    if d_weights is None:
        d_weights = torch.zeros(layer.num_tokens, layer.top_k, dtype=topk_weights.dtype, device=device)
    del act, dy
    if param_grads:
        x_gather = gather or quack_gathers_weight_rows(layer, cfg.wgrad_up, hidden, d_up, up_dims[0], d_b_up)
        x = hidden if x_gather else gather_rows(hidden, row_order, layer.top_k, out=scratch, offsets=offsets)
        d_w_up = weight_grad(layer, cfg.wgrad_up, p=x, p_gather=x_gather, q=d_up, q_gather=False, q_scale=False,
                             row_order=row_order, w=None, offsets=offsets, grad=w_up.shape, m_dim=up_dims[0],
                             n_dim=up_dims[1], bias_grad=d_b_up, q_interleaved=layer.h_interleaved)
        del x
    # With the saved buffers as scratch the input-gradient rows go there, by the Triton GEMM (torch._grouped_mm
    # would need a [rows, H] buffer of its own).
    combine_here = input_rows is None
    if combine_here and scratch is not None and scratch.dtype == w_up.dtype:
        input_rows = scratch
    d_x_rows = input_rows if input_first is not None else input_grad(d_up, input_rows)
    del d_up
    d_hidden = combine_input_rows(d_x_rows, slot_row, offsets, layer.num_tokens, layer.top_k, hidden.dtype) \
        if combine_here else None
    return d_hidden, d_weights, d_w_up, d_w_down, d_b_up, d_b_down, []


def _dgated_late(layer: Layer, cfg, *, dy, dy_gather, b, up, d_up, row_order, weights, d_weights, offsets):
    """config.gated_epilogue's backward under late_routing_weight by QuACK's dgated GEMM: the activation-gradient
    GEMM with the SwiGLU backward, the routing weights and their gradient in its epilogue (quack_gemm.dgated), no
    activation pass. Fills d_up and d_weights and returns w * act(h) ([rows, I], for the down weight's gradient);
    None where it does not run (the activation pass then runs on the interleaved h)."""
    from . import quack_gemm

    if not layer.h_interleaved or not cfg.quack or not quack_gemm.gates(cfg.quack) \
            or quack_gemm._dgated_entry() is None:  # a QuACK without it: the pass runs, QuACK stays on
        return None
    if up.stride(-1) != 1 or d_up.stride(-1) != 1 or not _use_quack(layer, cfg, dy, b, None, dy_gather):
        return None
    act = torch.empty(layer.num_slots, layer.inter, dtype=up.dtype, device=up.device)
    scale = weights.index_select(0, row_order).float()  # each row's routing weight
    try:
        sums = quack_gemm.dgated(dy, b, up, d_up, act, scale, layer.cu_seqlens(offsets), cfg.quack,
                                 a_idx=layer.token_rows(row_order) if dy_gather else None)
    except Exception as exc:  # noqa: BLE001 -- the GEMM and the activation pass run instead
        quack_gemm.failed(exc)
        return None
    counters["uniep_kernels"]["quack_gemms"] += 1
    routed = torch.arange(layer.num_slots, device=up.device) < offsets[-1]  # rows past them: not written, weight 0
    d_weights.view(-1)[row_order] = torch.where(routed, sums, 0.0).to(d_weights.dtype)
    return act


def _weight_grad_interleaved(layer: Layer, cfg, *, p, p_gather, q, q_gather, q_scale, row_order, offsets, grad,
                             m_dim, bias_grad):
    """weight_grad of an interleaved Q by QuACK, the gradient's [gate; up] dimension written through its
    ``concat`` (that dimension must be the strided one of the output QuACK writes); None where it cannot."""
    from . import quack_gemm

    if isinstance(grad, torch.Tensor) or q_gather or q_scale or bias_grad is not None:
        return None
    quack = _quack_wgrad_operands(layer, cfg, p, q, p_gather, m_dim)
    if quack is None:
        return None
    a_t, b_rows, transposed = quack
    out = torch.empty(tuple(grad), dtype=p.dtype, device=p.device)
    target = out.transpose(1, 2) if transposed else out
    if target.stride(2 if b_rows is q else 1) == 1:  # the halves are the contiguous dimension: not by concat
        return None
    try:
        quack_gemm.wgrad(a_t, b_rows, target, layer.cu_seqlens(offsets), cfg.quack,
                         a_idx=layer.token_rows(row_order) if p_gather else None, concat=True)
    except Exception as exc:  # noqa: BLE001 -- the copy in halves
        quack_gemm.failed(exc)
        return None
    counters["uniep_kernels"]["quack_gemms"] += 1
    return out


def combine_input_rows(rows, slot_row, offsets, num_tokens: int, top_k: int, dtype):
    """d_hidden from the input-gradient rows: each token's K rows summed in k order in fp32."""
    from .triton_routing import combine

    return combine(rows, slot_row, None, offsets, num_tokens, top_k, dtype)
