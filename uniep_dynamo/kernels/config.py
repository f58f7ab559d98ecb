"""The MegaKernel's parameter space: every knob of the Triton kernels in one object, with heuristics.

One ``MegaKernelConfig`` holds a ``GemmConfig`` per grouped GEMM of the layer (forward up and down
projections, backward activation gradient, input gradient and the two weight gradients) plus the
layer-wide knobs. A later search (the tuner) walks this space; here the heuristics pick a point by
shape.

Numerics contract (what a tuner may change freely):

- ``block_k`` of a GEMM is the K-dimension blocking: each ``tl.dot`` sums ``block_k`` products in the
  tensor core and the kernel adds the chunks in order, so a different ``block_k`` may change the
  rounding. It and ``per_expert_mm`` (below) are the "numerics knobs".
- Everything else -- ``block_m``, ``block_n``, ``group_m``, ``num_warps``, ``num_stages``,
  ``num_programs`` (persistent grid size), ``flatten``, ``warp_specialize``, ``fuse_gather``,
  ``pack_gate_up``, ``tma``, ``tma_weight_grad`` -- only schedules the same arithmetic:
  each output element is the same chain of ``block_k``-wide MMAs in the same order, the combine and
  the routing-weight gradient run in fixed-configuration kernels, and no reduction is split across
  programs. Results are bitwise identical across their values (tests/test_gpu.py holds this).
- ``block_m`` stays >= 64 and ``num_warps`` >= 4 so that Triton always lowers ``tl.dot`` to the same
  Hopper tensor-core instruction family (wgmma); mixing it with the older mma path could change the
  in-instruction rounding.
- ``grouped_mm`` runs a GEMM as ``torch._grouped_mm`` (CUTLASS's grouped GEMM) instead of the Triton kernel.
  It is a scheduling knob only where it is used: bf16 on a Hopper GPU (compute capability 9.x), where
  both are the same chain of wgmma instructions over K in order with an fp32 accumulator rounded once.
  benchmarks/probes/gemm_bits_probe.py found the six GEMMs of four layer shapes bitwise equal between the
  two on an H200, and tests/test_gpu_megakernel.py sweeps it with the other scheduling knobs. Elsewhere
  (fp16, whose ``torch._grouped_mm`` loops on the host; other GPUs; a bias; a fused gather; an epilogue
  beyond a plain store) the GEMM runs Triton. In Triton's interpreter (CPU tests) ``torch._grouped_mm``
  rounds differently from numpy, so it is used there only when a test asks (``megakernel.GROUPED_MM_INTERPRETED``).
- ``per_expert_mm`` runs a GEMM as one cuBLAS matmul per expert (``torch.mm`` into the expert's rows of the output,
  or into its slice of a weight gradient), which needs each expert's row count on the host: one host
  synchronization per op call (none in the EP layer, whose counts are on the host already). It is a numerics knob:
  cuBLAS picks its own kernel, and one that splits K (split-K, stream-K) would round differently. On an H200 the
  six GEMMs of the Mixtral-8x7B shape came out bitwise equal to torch._grouped_mm's
  (benchmarks/probes/cublas_loop_probe.py), 9% faster in all. Where the counts cannot be read (a CUDA graph
  being captured; the EP layer's device plan, whose counts stay on the device: megakernel.device_counts_only) or
  the GEMM does not qualify (a fused gather, a bias, an epilogue beyond a plain store, a GEMM
  that stores into EP peers), the GEMM takes the other knobs' path.
- ``quack`` runs a GEMM by QuACK's grouped GEMM (``quack-kernels``, the ``uniep[quack]`` extra; kernels/quack_gemm.py)
  at the tile config it names. A scheduling knob: on an H100 its six GEMMs of the Qwen3-30B-A3B shape gave
  torch._grouped_mm's bits (benchmarks/probes/quack_probe.py), being the same wgmma chain over K in order with one
  rounding; tests/test_gpu_megakernel.py::test_quack_gemms_are_bitwise_neutral holds it (2 of its 18 cases run on an
  H100 so far: the Qwen3-like layer, saved and in-place backward, the heuristic configs). It runs bf16 on a Hopper GPU
  with QuACK importable; the up projection's and its weight gradient's token-row gathers then happen in its loads
  (no permuted copy). A bias, a scaled gather (the weighted output-gradient rows) and a GEMM that stores into EP peers
  take the other knobs' path; so does a GEMM in a CUDA graph being captured unless its QuACK kernel was launched
  before the capture (quack_gemm.NotCompiledBeforeCapture).
- ``late_routing_weight`` (layer-wide) is a numerics knob: where the routing weight meets the output gradient in the
  backward (after the activation-gradient GEMM, in fp32, instead of before it, rounded into the rows that GEMM reads),
  and whether the routing weight's gradient is <dY W_down^T, act> over the intermediate size or <dY, down> over the
  hidden size. Within each setting every scheduling knob keeps the bits.
- ``gated_epilogue`` (layer-wide) is a numerics knob: the up projection of a SwiGLU layer (silu(gate) * up, HF's
  [gate; up] halves, no up bias) by QuACK's gated GEMM (``gemm_gated``), which computes the activation in its epilogue
  from the fp32 accumulator (the knob off: from the rounded h, as eager does) with QuACK's silu, and stores h with
  each gate column next to its up column (interleaved) for the backward. Under late_routing_weight the backward's
  activation-gradient GEMM is QuACK's dgated GEMM (``gemm_dgated``): the SwiGLU backward, the routing weights and
  their gradient in its epilogue, from its fp32 output; it sums that gradient over each column tile and then the
  tiles' parts in order, so under this knob the column tile of ``grad_act.quack`` is a numerics value
  (``numerics_key`` holds it; gated_config sets it). Elsewhere the backward's activation pass reads the interleaved
  layout. The two GEMMs that read d_h against the [gate; up] weight (the input gradient and the up weight's gradient)
  run by QuACK with the weight's halves read interleaved (its ``concat_layout``), or, where QuACK cannot take them,
  from a copy of d_h in halves. Where QuACK's gated GEMM cannot run (not installed, not a Hopper GPU, a CUDA graph
  capturing a kernel not launched before) the forward computes h and the activation as with the knob off and stores
  h interleaved: the layout holds, the bits are the knob-off ones. Each row is computed alone, so the EP layers'
  chunks, which run the same calls over their rows, keep the single-GPU op's bits. Off by default (heuristic_config
  says why); UNIEP_GATED_EPILOGUE=0 / 1 sets it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass

NUMERICS_KNOBS = ("block_k", "per_expert_mm", "late_routing_weight", "gated_epilogue")
SCHEDULING_KNOBS = ("block_m", "block_n", "group_m", "num_warps", "num_stages", "num_programs", "flatten",
                    "warp_specialize", "grouped_mm", "quack")
LAYER_SCHEDULING_KNOBS = ("fuse_gather", "pack_gate_up", "tma", "tma_weight_grad")
GEMMS = ("up", "down", "grad_act", "grad_input", "wgrad_up", "wgrad_down")


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128  # rows of the output tile (token rows; weight-gradient: rows of the weight)
    block_n: int = 128  # columns of the output tile
    block_k: int = 64   # reduction chunk per tl.dot: the one knob that may change numerics
    group_m: int = 8    # row tiles that share a column tile in launch order (L2 reuse of weights)
    num_warps: int = 8
    num_stages: int = 3
    # Persistent grid: 0 launches one program per tile; N > 0 launches N programs that walk the
    # tiles in strides of N (the tile count is only known on the device, from the routing plan).
    num_programs: int = 0
    # Triton's loop options on the tile loop (for a persistent grid): flatten the tile and K loops into one
    # software pipeline (the next tile's loads start during this tile's epilogue), and warp specialization
    # (producer and consumer warps). They schedule the same MMAs.
    flatten: bool = False
    warp_specialize: bool = False
    # Run this GEMM as torch._grouped_mm (CUTLASS) where it gives the Triton kernel's bits (see the module
    # docstring); the tile knobs above then apply only where it falls back to Triton.
    grouped_mm: bool = False
    # Run this GEMM as one cuBLAS matmul per expert (a numerics knob: see the module docstring); it takes
    # precedence over grouped_mm where it applies.
    per_expert_mm: bool = False
    # Run this GEMM by QuACK's grouped GEMM (kernels/quack_gemm.py: CuTe DSL, persistent, warp-specialized; the
    # token-row gathers of the up projection and its weight gradient inside the GEMM) with this tile config,
    # "<tile_m>x<tile_n>/<pingpong|coop>/<cluster_m>x<cluster_n>"; "" runs the other knobs' path, as does a GPU or
    # call QuACK cannot take. Same bits as torch._grouped_mm (see the module docstring). Precedence:
    # per_expert_mm, then quack, then grouped_mm, then Triton.
    quack: str = ""

    def validate(self, interpret: bool = False) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"uniep: {name}={v} must be a power of two >= 16")
        if not interpret and (self.block_m < 64 or self.num_warps < 4):
            raise ValueError("uniep: block_m >= 64 and num_warps >= 4 keep one tensor-core path (see config.py)")
        if self.group_m < 1 or self.num_stages < 1 or self.num_programs < 0:
            raise ValueError(f"uniep: bad GEMM config {self}")
        self.validate_quack()

    def validate_quack(self) -> None:
        """A malformed QuACK config raises ValueError (quack_gemm.parse_config)."""
        if self.quack:
            from .quack_gemm import parse_config

            parse_config(self.quack)


@dataclass(frozen=True)
class MegaKernelConfig:
    up: GemmConfig = GemmConfig()
    down: GemmConfig = GemmConfig()
    grad_act: GemmConfig = GemmConfig()
    grad_input: GemmConfig = GemmConfig()
    wgrad_up: GemmConfig = GemmConfig()
    wgrad_down: GemmConfig = GemmConfig()
    # Gather token rows (and scale output-gradient rows by their routing weight) inside the GEMMs
    # (True), or copy them into expert-sorted buffers first (False). Measured on an H200 (BENCHMARKS.md):
    # the in-loop gather costs the weight-gradient GEMMs about half their speed, so False is the default.
    fuse_gather: bool = False
    # Gated up projection: one accumulator over a packed [gate block | up block] weight tile (True),
    # or two accumulators (False). Bitwise the same; packing issues one wide MMA per K step.
    pack_gate_up: bool = True
    # Load the row GEMMs' (up, down, grad_act, grad_input) operand tiles with Hopper's bulk tensor copies
    # (Triton tensor descriptors) instead of pointer loads, where the operands allow it: unit column
    # stride, 16-byte row strides, K a multiple of block_k, no fused gather; the packed gate|up weight
    # tile and an interleaved gate's weights keep pointer loads. The same tiles reach the same MMAs:
    # bitwise the same. The GPU heuristics turn it on for experts with many rows (see heuristic_config).
    tma: bool = False
    # The same for the weight-gradient GEMMs: whole chunks of an expert's rows by tensor descriptors,
    # the last partial chunk by masked loads. Measured slower on an H200 (BENCHMARKS.md): off.
    tma_weight_grad: bool = False
    # A numerics knob (see the module docstring): where the routing weight meets the output gradient in the
    # backward. False: the activation-gradient GEMM reads the weighted rows w * dY (rounded), and the weight's
    # gradient is <dY, down> over the hidden size. True: that GEMM reads dY unweighted (gathered inside the GEMM where
    # QuACK or fuse_gather can, with no weighted copy), the activation backward scales its output by w, takes the
    # weight's gradient as <dY W_down^T, act> over the intermediate size, and leaves w * act for the down weight's
    # gradient, dY_e^T (w * act)_e: the <dY, down> reduction over [rows, H] is gone, the weighted gather is a plain
    # one (inside the GEMMs where QuACK or fuse_gather gathers), and the backward reads no ``down``. Not for weights
    # that need no gradient (the EP layers' received rows, which arrive weighted) and not with a down bias (its
    # gradient sums the weighted rows): False's path runs there. On in the GPU heuristics (heuristic_config says
    # why), off in the interpreter's; UNIEP_LATE_ROUTING_WEIGHT=0 / 1 sets it.
    late_routing_weight: bool = False
    # A numerics knob (see the module docstring): the SwiGLU up projection by QuACK's gated GEMM, the activation
    # from the fp32 accumulator in its epilogue, h stored with gate and up columns interleaved. It needs ``up.quack``
    # set; off in the heuristics (heuristic_config says why); UNIEP_GATED_EPILOGUE=1 or gated_config turns it on.
    gated_epilogue: bool = False

    def replace_gemms(self, **changes) -> "MegaKernelConfig":
        """The same config with ``changes`` (GemmConfig fields) applied to every GEMM."""
        return dataclasses.replace(self, **{g: dataclasses.replace(getattr(self, g), **changes) for g in GEMMS})

    def numerics_key(self) -> tuple:
        """The knob values that may change results; configs with equal keys give bitwise equal results."""
        return tuple((getattr(self, g).block_k, getattr(self, g).per_expert_mm) for g in GEMMS) + \
            (self.late_routing_weight, self.gated_epilogue, self.gated_up(), self.gated_reduce_tile())

    def gated_up(self) -> bool:
        """Under gated_epilogue, whether the up projection's QuACK config can run QuACK's gated GEMM: it decides the
        saved h's layout (megakernel._interleaves_h) and the activation's bits, so it is a numerics value there (the
        forward and its backward must agree on it, and a tuned config may not change it)."""
        if not (self.gated_epilogue and self.up.quack):
            return False
        from .quack_gemm import gates

        return gates(self.up.quack)

    def gated_reduce_tile(self) -> int | None:
        """Under gated_epilogue, the column tile of the activation-gradient GEMM's QuACK config: QuACK's dgated GEMM
        sums the routing weight's gradient over each column tile, then the tiles' parts in order, so this width sets
        that sum's rounding (a numerics value; the other QuACK tile knobs only schedule)."""
        if not (self.gated_epilogue and self.grad_act.quack):
            return None
        from .quack_gemm import parse_config

        return parse_config(self.grad_act.quack)[1]


@functools.lru_cache(maxsize=1024)  # a pure function of its arguments; the configs are frozen
def heuristic_config(num_rows: int, num_experts: int, hidden: int, inter: int,
                     interpret: bool = False) -> MegaKernelConfig:
    """A config by shape. ``num_rows`` = T*K routed rows, ``inter`` = the expert's intermediate size.

    For the interpreter (CPU tests) small tiles, since it runs each program serially in numpy.
    """
    if interpret:
        small = GemmConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=1, num_stages=1)
        return MegaKernelConfig(*(small,) * len(GEMMS))
    # Picked from benchmarks/sweep_megakernel.py on an H200 (bf16, T=8192, Mixtral-8x7B and
    # Qwen3-30B-A3B shapes); every GEMM keeps block_k=64, so all heuristic choices share numerics.
    # Plain GEMMs: 128x256 tiles. The gated up projection: 128 activation columns per tile, that is a
    # 128x256 accumulator over the packed gate and up blocks.
    # Both shapes chose the same tiles. Few rows per expert (decoding-sized batches): 64-row tiles, so
    # that a tile is not mostly padding (block_m only schedules: same numerics).
    block_m = 64 if num_rows < 64 * num_experts else 128
    wide = GemmConfig(block_m=block_m, block_n=256, block_k=64, num_warps=8, num_stages=3)
    deep = GemmConfig(block_m=block_m, block_n=256, block_k=64, num_warps=8, num_stages=4)
    up = GemmConfig(block_m=block_m, block_n=128, block_k=64, num_warps=8, num_stages=4)
    wgrad = GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
    # Tensor-descriptor tiles in the row GEMMs: faster on an H200 with many rows per expert (Mixtral-8x7B
    # at T=8192, 2048 rows each: 31.39 -> 30.44 ms a layer; Qwen3-30B-A3B at T=32768, 2048 rows each:
    # 17.21 -> 16.81), slower with few (Qwen3-30B-A3B at T=8192, 512 rows: 4.98 -> 5.11 ms; OLMoE's 1024 and
    # DeepSeek-V3's 256 rows also lost). BENCHMARKS.md.
    tma = num_rows >= 2048 * num_experts
    # torch._grouped_mm (CUTLASS; the same bits, see above) for every GEMM but the backward row GEMMs (grad_act,
    # grad_input) of experts with at most 1024 rows and hidden >= 4096. On an H200 (bf16, T=8192, forward +
    # backward with the in-place backward; BENCHMARKS.md, session 12) against Triton for every GEMM:
    # Qwen3-30B-A3B 5.21 -> 4.94 ms, OLMoE 5.93 -> 5.64, Mixtral-8x7B 30.66 -> 29.59. DeepSeek-V3's experts
    # (256 rows, hidden 7168) 48.09 -> 45.40 with every GEMM, 44.69 with its grad_act and grad_input by Triton,
    # which led on those two alone by 14% and 5% (benchmarks/probes/gemm_bits_probe.py).
    triton_row_bwd = num_rows <= 1024 * num_experts and hidden >= 4096
    # Decode-sized calls (at least one row an expert on average, fewer than 64): the forward's two GEMMs by Triton.
    # On an H200 (bf16, the forward alone under no_grad, in CUDA graphs, back to back; BENCHMARKS.md, 2026-11-29
    # twenty-second session): Qwen3-30B-A3B at T = 32 / 256 0.424 -> 0.304 / 0.450 -> 0.360 ms, Mixtral-8x7B at
    # T = 32 1.053 -> 0.694; at T = 1 (8 rows over 128 experts) torch._grouped_mm led, 0.182 against 0.227.
    triton_forward = num_experts <= num_rows < 64 * num_experts
    cutlass = {g for g in GEMMS if not (triton_row_bwd and g in ("grad_act", "grad_input"))
               and not (triton_forward and g in ("up", "down"))}
    gemms = dict(up=up, down=wide, grad_act=deep, grad_input=deep, wgrad_up=dataclasses.replace(wgrad, num_stages=4),
                 wgrad_down=wgrad)
    # One cuBLAS matmul per expert (per_expert_mm) where the experts are few and large: on an H200 (bf16, the
    # Mixtral-8x7B shape at T=8192, 2048 rows an expert) 1.02-1.21x torch._grouped_mm on each GEMM but the up
    # projection (0.99x), 1.09x over the six, bitwise equal; with 64 experts of 1024 rows (OLMoE) 0.39-0.85x, with
    # 128 of 512 (Qwen3-30B-A3B) 0.19-0.41x (benchmarks/probes/cublas_loop_probe.py).
    per_expert = {"down", "grad_act", "grad_input", "wgrad_up", "wgrad_down"} \
        if num_experts <= 16 and num_rows >= 1024 * num_experts else set()
    # QuACK's grouped GEMM (the quack knob; it runs only where quack-kernels is installed on a Hopper GPU) for every
    # GEMM of the shapes it was measured on: 64 or more experts with 512 or more rows each (a call of fewer rows pays
    # its host dispatch, about 0.05 ms a GEMM, unmeasured against its gain). Its configs: the fastest of QuACK's
    # Hopper configs for each GEMM on an H100 (bf16, Qwen3-30B-A3B shape at T = 8192; benchmarks/probes/quack_probe.py,
    # each GEMM timed alone in one run): 3.83 ms for the six against 4.41 ms for torch._grouped_mm with the two row
    # gathers it needs. The layer, forward + backward, on an H100 (two alternating rounds, BENCHMARKS.md):
    # Qwen3-30B-A3B 4.58 -> 4.17-4.20 ms back to back at T = 8192, 16.08-16.17 -> 14.77-14.90 at T = 32768. Not where
    # the experts are few and large: Mixtral-8x7B's up projection by QuACK made its layer 26.57-27.08 -> 27.30-27.82.
    # late_routing_weight (a numerics knob: the routing weights applied after the activation-gradient GEMM) on every
    # GPU shape, for memory: the backward reads no down rows, so the op keeps none between forward and backward
    # (on an H200, bf16, T = 8192: 448.5 -> 192.5 MB held by a Qwen3-30B-A3B layer, 512.5 -> 256.5 on OLMoE, where
    # inductor's compile holds 801.6 and 897.6; saved_memory_probe.py). Its speed is the knob-off path's within the
    # runs' spread: the layer, forward + backward, moved by +0.3% to +2.9% back to back on Qwen3-30B-A3B, OLMoE,
    # Qwen3-30B-A3B at T = 32768 and DeepSeek-V3, -0.3% on Mixtral-8x7B (BENCHMARKS.md, 2026-11-27 eighth session).
    # The EP layers' experts ops get rows already weighted and keep the knob-off numerics: they equal the single-GPU
    # op with the knob off (UNIEP_LATE_ROUTING_WEIGHT=0). With QuACK gathering the output-gradient rows inside the
    # two GEMMs that read them, those GEMMs took 0.16 ms more than the glue the knob saved: they read a copy.
    late = True
    quack = QUACK_CONFIGS if num_experts >= 64 and num_rows >= 512 * num_experts and not per_expert else {}
    # gated_epilogue (a numerics knob: the SwiGLU and its backward in the QuACK GEMMs' epilogues, as SonicMoE does)
    # stays off by default: on an H200 (bf16, T = 8192, BENCHMARKS.md 2026-11-28 seventeenth session) it made the
    # layer's GPU time shorter, back to back 3.808 -> 3.748 ms on Qwen3-30B-A3B and 4.534 -> 4.451 on OLMoE, but its
    # synchronized step longer, 4.458 -> 4.894 and 5.143 -> 5.438. Timed again in alternation (eighteenth session,
    # benchmarks/probes/ab_probe.py, 7 rounds): Qwen3-30B-A3B 4.636 -> 4.857 ms synchronized, 4.063 -> 4.091 back
    # to back (slower both ways); OLMoE 5.626 -> 5.726 and 4.927 -> 4.831. Not host time: a step's host time moved
    # by -0.09 and +0.48 ms in two calls (step_host_profile.py), its backward's host time by none (cProfile's
    # callees). UNIEP_GATED_EPILOGUE=1 turns it on.
    return MegaKernelConfig(**{g: dataclasses.replace(c, grouped_mm=g in cutlass, per_expert_mm=g in per_expert,
                                                      quack=quack.get(g, ""))
                               for g, c in gemms.items()}, tma=tma, late_routing_weight=late)


QUACK_CONFIGS = {"up": "128x256/coop/2x1", "down": "128x208/pingpong/1x2", "grad_act": "192x128/pingpong/1x2",
                 "grad_input": "192x128/pingpong/1x2", "wgrad_up": "256x128/coop/2x1",
                 "wgrad_down": "192x128/pingpong/1x2"}


# The activation-gradient GEMM's QuACK tile under gated_epilogue (QuACK's dgated GEMM): SonicMoE's autotuned choice for
# its dgated GEMM on Qwen3-30B-A3B (BENCHMARKS.md, 2026-11-28 sixteenth session); at uniep's 192x128/pingpong/1x2
# the dgated GEMM took 0.69 ms on an H200 against 0.34 + 0.16 for the GEMM and the activation pass it replaces.
GATED_GRAD_ACT_CONFIG = "128x256/coop/2x1"


def gated_config(cfg: MegaKernelConfig) -> MegaKernelConfig:
    """``cfg`` with gated_epilogue on, its activation-gradient GEMM (QuACK's dgated GEMM, where QuACK runs it) at
    GATED_GRAD_ACT_CONFIG."""
    if not cfg.grad_act.quack:
        return dataclasses.replace(cfg, gated_epilogue=True)
    return dataclasses.replace(cfg, gated_epilogue=True,
                               grad_act=dataclasses.replace(cfg.grad_act, quack=GATED_GRAD_ACT_CONFIG))

_OVERRIDE: list[MegaKernelConfig] = []


@contextlib.contextmanager
def use_config(config: MegaKernelConfig):
    """Run the Triton MegaKernel with ``config`` instead of the heuristics (tests, benchmarks, tuner).

    The config is read when the op runs, so wrap the calls (and the backward) in this context."""
    _OVERRIDE.append(config)
    try:
        yield config
    finally:
        _OVERRIDE.pop()


def current_config(num_rows: int, num_experts: int, hidden: int, inter: int, interpret: bool,
                   dtype=None, device=None) -> MegaKernelConfig:
    """The config the op runs with: ``use_config``'s, else a tuned one from the tuning cache (which the tuner,
    uniep/tuner.py, writes; uniep/tuning_cache.py reads it) for this GPU and shape, else the heuristics'. A cached
    config whose numerics knobs differ from the heuristics' is not used: tuning may only change the schedule."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    return _current_config(num_rows, num_experts, hidden, inter, interpret, dtype, device)


def late_routing_weight_on(interpret: bool) -> bool:
    """The late_routing_weight value the op runs with, read without the shapes (the autograd formula decides by it,
    when the forward runs, whether the backward needs ``down``): use_config's, else UNIEP_LATE_ROUTING_WEIGHT's, else
    the heuristics' (the same for every shape; a tuned config never changes a numerics knob)."""
    if _OVERRIDE:
        return _OVERRIDE[-1].late_routing_weight
    value = _late_env()
    return value if value is not None else heuristic_config(65536, 128, 2048, 768, interpret).late_routing_weight


def _late_env() -> bool | None:
    """``UNIEP_LATE_ROUTING_WEIGHT=0`` / ``=1`` sets the late_routing_weight numerics knob over the heuristics' and
    the tuning cache's choice (the bits of the other numerics, e.g. to compare with a run that had them); None where
    it is not set. It is read when the op's forward runs, a compiled graph's when it is traced (whether the backward
    keeps the down rows): a backward whose forward kept none runs the knob's path whatever the variable says then."""
    value = os.environ.get("UNIEP_LATE_ROUTING_WEIGHT", "")
    return value == "1" if value in ("0", "1") else None


def _gated_env() -> bool | None:
    """``UNIEP_GATED_EPILOGUE=0`` / ``=1`` sets the gated_epilogue numerics knob over the heuristics' and the tuning
    cache's choice; None where it is not set. Read when a call's config is picked, by the forward and again by its
    backward, which must read the layout the forward stored: set it before a step, not between a forward and its
    backward (a backward that would read the other layout raises: megakernel.check_h_layout)."""
    value = os.environ.get("UNIEP_GATED_EPILOGUE", "")
    return value == "1" if value in ("0", "1") else None


def _numerics_from_env(cfg: MegaKernelConfig) -> MegaKernelConfig:
    """``cfg`` with the numerics knobs that UNIEP_LATE_ROUTING_WEIGHT and UNIEP_GATED_EPILOGUE set (the latter on:
    gated_config's)."""
    late, gated = _late_env(), _gated_env()
    if late is not None and cfg.late_routing_weight != late:
        cfg = dataclasses.replace(cfg, late_routing_weight=late)
    if gated is not None and cfg.gated_epilogue != gated:
        cfg = gated_config(cfg) if gated else dataclasses.replace(cfg, gated_epilogue=False)
    return cfg


def _current_config(num_rows, num_experts, hidden, inter, interpret, dtype, device) -> MegaKernelConfig:
    """The heuristics' config, or the tuning cache's for this GPU and shape where its numerics are theirs; the
    variables' numerics knobs (_numerics_from_env) applied to both before they are compared."""
    base = heuristic_config(num_rows, num_experts, hidden, inter, interpret)
    heuristic = _numerics_from_env(base)
    if interpret or dtype is None or device is None or device.type != "cuda":
        return heuristic
    from .. import tuning_cache

    key = tuning_cache.shape_key(dtype, num_rows, num_experts, hidden, inter)
    tuned = cached_config(tuning_cache.gpu_name(device), key, base)  # an older entry's missing knobs: base's
    if tuned is None:
        return heuristic
    tuned = _numerics_from_env(tuned)
    if tuned.numerics_key() != heuristic.numerics_key():
        if key not in _WARNED:
            _WARNED.add(key)
            tuning_cache.log.warning("uniep: the tuned config for %s changes numerics knobs; the heuristics apply",
                                     key)
        return heuristic
    return tuned


_WARNED: set = set()  # cache keys already warned about


def config_to_dict(cfg: MegaKernelConfig) -> dict:
    """The JSON object of a config, as the tuning cache stores it."""
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict, heuristic: MegaKernelConfig | None = None) -> MegaKernelConfig:
    """config_to_dict's inverse (entries written before the tma knobs existed read them as off, and before
    late_routing_weight or gated_epilogue existed as ``heuristic``'s value, since the tuner keeps the heuristics'
    numerics; entries that still name the removed act_grad_in_epilogue knob are read where it was off, as the tuner
    always left it)."""
    if data.get("act_grad_in_epilogue", False):
        raise ValueError("act_grad_in_epilogue=True: a numerics knob this uniep no longer has")
    gemms = {g: GemmConfig(**data[g]) for g in GEMMS}
    for g in gemms.values():  # a malformed QuACK config is refused here (cached_config then ignores the entry)
        g.validate_quack()
    layer = {k: data[k] for k in ("fuse_gather", "pack_gate_up")}
    for knob in ("tma", "tma_weight_grad"):  # entries written before these knobs existed
        layer[knob] = bool(data.get(knob, False))
    for knob in ("late_routing_weight", "gated_epilogue"):  # entries written before these numerics knobs existed
        layer[knob] = bool(data.get(knob, getattr(heuristic, knob) if heuristic is not None else False))
    return MegaKernelConfig(**gemms, **layer)


def cached_config(gpu_name: str, key: str, heuristic: MegaKernelConfig | None = None) -> MegaKernelConfig | None:
    """The tuned MegaKernelConfig of the tuning cache's entry ``key`` for this GPU, or None (none, UNIEP_TUNE=0,
    or an entry that does not parse, with a warning)."""
    from .. import tuning_cache

    entry = tuning_cache.entry(gpu_name, key)
    if entry is None:
        return None
    try:
        return config_from_dict(entry["config"], heuristic)
    except (KeyError, TypeError, ValueError) as exc:
        tuning_cache.log.warning("uniep: ignoring the tuning cache entry %s (%s)", key, exc)
        return None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers (triton.cdiv is a constexpr function: several µs a call on the launch path)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as triton.next_power_of_2, without its call overhead."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
