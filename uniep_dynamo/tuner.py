"""The MegaKernel's parameter search: one declarative space, a tuner that measures it, and a cache on disk.

Space. ``SPACE`` lists the values of each scheduling knob of a grouped GEMM (kernels/config.py) and
``LAYER_SPACE`` the layer-wide ones. The numerics knobs (``block_k``, ``per_expert_mm``) are not
searched: every candidate keeps the heuristic's values, so a tuned config computes the same bits as the
heuristic one (config.py's numerics contract), and the tuner checks it on every candidate anyway.
``gemm_candidates`` enumerates a GEMM's points and prunes those that cannot run or cannot win:
shared memory over the device's limit, an fp32 accumulator over ``MAX_ACC_REGS`` registers per thread,
a tile wider than the problem, or a config ``GemmConfig.validate`` refuses. ``EP_SPACE`` holds the
overlapped EP layer's knobs (ep/config.py's OverlapConfig: pipeline chunks, overlap on/off, the transfer path,
the transfer kernel's programs (its SMs for communication) and their block, whether the GEMMs push their
results into the peers themselves and from which chunk on, the copy engines' batched copies and tapered chunks);
``ep_candidates`` prunes repeats (more chunks than local experts, programs of a path without the kernel, the
kernel past its rank limit). None of them changes numerics.

Tuner. ``tune_shape`` measures one layer shape (forward + backward of ``uniep.moe_experts`` on CUDA with the
in-place backward the backend uses, CUDA events, the same seeded inputs for every candidate; a SwiGLU layer with [E, out, in] weights stands
for every gate and weight layout of that shape, which the cache key does not tell apart): coordinate descent, one GEMM at a time, then
the layer knobs, at most ``budget`` candidates per knob group; the winner and the heuristic are then
timed again, in alternation, for the reported times. A candidate that fails to compile or
launch, or whose output or any gradient differs by one bit from the heuristic's, is rejected. The
result says how many were measured and rejected, and how long it took.

EP tuner. ``tune_ep`` runs in every rank of the EP group: each candidate's forward + backward, with the
same inputs; a candidate whose output or any gradient differs by one bit from the default config's on
any rank is rejected; its time is the slowest rank's (all-reduced), so every rank picks the same winner.
The GEMM tiles stay the single-GPU op's (tune those with ``tune_shape``).

Cache. The tuner writes its winners into the tuning cache (tuning_cache.py: one JSON file per uniep, torch,
triton and GPU model; entries keyed by dtype, E, H, I, the routed-row count rounded up to a power of two and the
EP size). The ops read it from below, without importing the tuner: ``kernels/config.current_config`` when the
MegaKernel runs, the EP layer's knob lookup (``ep.config.cached_knobs``) when it runs; a missing entry uses the
heuristics or defaults and never blocks (``UNIEP_TUNE=0`` ignores the cache).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from .kernels import config as kconfig
from .kernels.config import GEMMS, GemmConfig, MegaKernelConfig, cached_config, config_from_dict, config_to_dict
from .ep.config import OverlapConfig, cached_ep_config, ep_config_to_dict, ep_rows_key
from .tuning_cache import CACHE_FORMAT, cache_dir, cache_path, load_entries, shape_key, store_entries

log = logging.getLogger("uniep")

SPACE = {
    "block_m": (64, 128),
    "block_n": (64, 128, 256),
    "group_m": (4, 8, 16),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
    "num_programs": (0, "sms"),  # 0: a program per tile; "sms": a persistent grid of one program per SM
    # Triton's loop options on the persistent tile loop (only with "sms"): in isolation they sped up some GEMMs
    # by up to 16% on an H200 and slowed others; across the layer they gained nothing (BENCHMARKS.md)
    "flatten": (False, True),
    "warp_specialize": (False, True),
}
# Besides the tiles, each GEMM may run as torch._grouped_mm (GemmConfig.grouped_mm: CUTLASS, the same bits on
# Hopper); gemm_candidates offers the heuristic's tiles with the other implementation first.
# QuACK's tile configs a GEMM may take (GemmConfig.quack; kernels/quack_gemm.py): the winners of QuACK's own Hopper
# search for the six GEMMs of the Qwen3-30B-A3B shape on an H100 (benchmarks/probes/quack_probe.py), and its default.
QUACK_SPACE = ("128x256/coop/2x1", "128x208/pingpong/1x2", "192x128/pingpong/1x2", "256x128/coop/2x1",
               "128x192/pingpong/2x1")
LAYER_SPACE = {"fuse_gather": (False, True), "pack_gate_up": (True, False), "tma": (True, False),
               "tma_weight_grad": (False, True)}
SMEM_LIMIT = {9: 227 * 1024}  # bytes of shared memory a block may use, by compute capability major (Hopper)
DEFAULT_SMEM_LIMIT = 99 * 1024
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread; more spills (255 is the hardware's cap)


# ---- the space -------------------------------------------------------------------------------------

def gemm_candidates(base: GemmConfig, *, n_dim: int, smem_limit: int, sm_count: int, elem_bytes: int = 2,
                    n_factor: int = 1, quack: bool = True) -> list[GemmConfig]:
    """Every valid point of SPACE for one GEMM, with ``base``'s block_k; ``base`` first, then ``base`` with the
    other of torch._grouped_mm and Triton (``grouped_mm`` flipped, no QuACK), then (``quack``: QuACK runs here)
    ``base`` without QuACK and with each of QUACK_SPACE's configs, then Triton's tiles. ``n_factor`` = 2 for the
    packed gated up projection, whose accumulator spans two ``block_n`` blocks."""
    flipped = dataclasses.replace(base, grouped_mm=not base.grouped_mm, quack="")
    out, seen = [base, flipped], {base, flipped}
    if quack:
        for q in ("",) + QUACK_SPACE:
            cfg = dataclasses.replace(base, quack=q)
            if cfg not in seen:
                seen.add(cfg)
                out.append(cfg)
    for values in itertools.product(*SPACE.values()):
        knobs = dict(zip(SPACE, values))
        if knobs["num_programs"] != "sms" and (knobs["flatten"] or knobs["warp_specialize"]):
            continue  # a program per tile: the tile loop runs once, so its loop options schedule nothing
        knobs["num_programs"] = sm_count if knobs["num_programs"] == "sms" else 0
        cfg = dataclasses.replace(base, grouped_mm=False, quack="", **knobs)
        if cfg not in seen and prune_reason(cfg, n_dim=n_dim, smem_limit=smem_limit, elem_bytes=elem_bytes,
                                            n_factor=n_factor) is None:
            seen.add(cfg)
            out.append(cfg)
    return out


def prune_reason(cfg: GemmConfig, *, n_dim: int, smem_limit: int, elem_bytes: int = 2, n_factor: int = 1):
    """Why ``cfg`` is not worth measuring, or None."""
    try:
        cfg.validate(interpret=False)
    except ValueError as exc:
        return str(exc)
    smem = cfg.num_stages * (cfg.block_m + cfg.block_n * n_factor) * cfg.block_k * elem_bytes
    if smem > smem_limit:
        return f"shared memory {smem} B > {smem_limit} B"
    regs = cfg.block_m * cfg.block_n * n_factor // (cfg.num_warps * 32)
    if regs > MAX_ACC_REGS:
        return f"{regs} accumulator registers per thread > {MAX_ACC_REGS}"
    if cfg.block_n > max(64, 1 << max(n_dim - 1, 0).bit_length()):
        return f"block_n {cfg.block_n} wider than the problem's {n_dim} columns"
    if cfg.warp_specialize and cfg.num_warps < 8:
        # Triton 3.6's NVGPUWarpSpecialization pass refused every such candidate on an H200 (all the tuner's
        # compile failures there, BENCHMARKS.md); with 8 warps it compiles
        return "warp specialization with fewer than 8 warps does not compile (Triton's pass fails)"
    return None


def _gemm_dims(hidden: int, inter: int, gated: bool, pack: bool) -> dict:
    """(output columns, n_factor) per GEMM of the layer."""
    up_factor = 2 if gated and pack else 1
    return {"up": (inter, up_factor), "down": (hidden, 1), "grad_act": (inter, 1), "grad_input": (hidden, 1),
            "wgrad_up": ((2 if gated else 1) * inter, 1), "wgrad_down": (hidden, 1)}


# ---- the cache -------------------------------------------------------------------------------------
#
# The file, its format, reads and writes: tuning_cache.py (below the kernels, which read it); the MegaKernelConfig's
# JSON form: kernels/config.py; the EP knobs': ep/config.py. Re-exported here for the tuner's callers.

# ---- the tuner -------------------------------------------------------------------------------------

@dataclass
class TuneResult:
    key: str
    heuristic_ms: float
    tuned_ms: float
    config: MegaKernelConfig
    measured: int = 0
    rejected: dict = field(default_factory=dict)  # reason -> count
    seconds: float = 0.0
    failures: list = field(default_factory=list)  # the first few refused candidates: what and why

    @property
    def speedup(self) -> float:
        return self.heuristic_ms / self.tuned_ms


MAX_FAILURES_KEPT = 16


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:limit]


def time_cuda(run, iters: int, warmup: int) -> float:
    """Median milliseconds of ``run()`` over ``iters`` calls after ``warmup`` ones, by CUDA events."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def time_host(run, iters: int, warmup: int) -> float:
    """Median milliseconds of ``run()`` over ``iters`` calls after ``warmup`` ones, by the host clock."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _confirm(base, best, timed, rounds: int = 3):
    """(base ms, winner, winner ms) from timing ``base`` and ``best`` again in alternation, the least of
    ``rounds`` each; the winner is ``base`` unless ``best`` still beats it."""
    again = {"base": [], "best": []}
    for _ in range(rounds):
        again["base"].append(timed(base))
        again["best"].append(timed(best))
    base_ms, best_ms = min(again["base"]), min(again["best"])
    return (base_ms, best, best_ms) if best_ms < base_ms else (base_ms, base, base_ms)


def _spread(items: list, budget: int) -> list:
    """``budget`` items spread evenly over ``items`` (the first always kept), deterministically."""
    if budget <= 0 or len(items) <= budget:
        return items
    step = (len(items) - 1) / (budget - 1) if budget > 1 else 0
    return [items[round(i * step)] for i in range(budget)]


def tune_shape(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
               dtype: torch.dtype = torch.bfloat16, budget: int = 8, iters: int = 10, warmup: int = 3,
               progress=None, seed: int = 0) -> TuneResult:
    """Search the space for one layer shape on the current CUDA device (see the module docstring)."""
    from .kernels import gate_program
    from .spec import ExpertsSpec

    started = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    smem_limit = SMEM_LIMIT.get(props.major, DEFAULT_SMEM_LIMIT)
    g = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]).to(device)
    weights = torch.rand(num_tokens, top_k, generator=g).to(device, dtype)
    w_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5).to(device, dtype)
    grad = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
    silu_glu = gate_program.encode("chunk", gate_program.SILU_GLU_EXPR)
    # the in-place backward, as the backend's compiled layers run it (its input-gradient GEMM writes into a
    # saved buffer, and so runs Triton whatever the grouped_mm knob says)
    spec = ExpertsSpec("oi", "oi", silu_glu, dtype, reuse_saved=True).encode()
    leaves = [t.requires_grad_() for t in (hidden_states, weights, w_up, w_down)]

    def run(cfg):
        for t in leaves:
            t.grad = None
        with kconfig.use_config(cfg):
            out = torch.ops.uniep.moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], None, None, [],
                                              spec)[0]
            out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    def timed(cfg) -> float:
        return time_cuda(lambda: run(cfg), iters, warmup)

    num_rows = num_tokens * top_k
    heuristic = kconfig.heuristic_config(num_rows, num_experts, hidden, inter)
    reference = [t.clone() for t in run(heuristic)]
    best, best_ms = heuristic, timed(heuristic)
    heuristic_ms = best_ms
    result = TuneResult(shape_key(dtype, num_rows, num_experts, hidden, inter), heuristic_ms, best_ms, heuristic)

    from .kernels import quack_gemm

    def consider(name, cfg):
        nonlocal best, best_ms
        quack_failed = quack_gemm.failure() is not None
        try:
            got = run(cfg)
            if not quack_failed and quack_gemm.failure():  # a QuACK GEMM raised inside: it ran the other path
                raise RuntimeError(quack_gemm.failure())
        except Exception as exc:  # noqa: BLE001 -- a config the compiler or the device refuses
            reason = f"failed: {type(exc).__name__}"
            result.rejected[reason] = result.rejected.get(reason, 0) + 1
            if len(result.failures) < MAX_FAILURES_KEPT:
                part = getattr(cfg, name, None)  # the GEMM's config; None for the layer knobs
                result.failures.append({"part": name, "config": dataclasses.asdict(part) if part is not None else
                                        config_to_dict(cfg), "error": f"{type(exc).__name__}: {_first_line(exc)}"})
            return
        if not all(torch.equal(a, b) for a, b in zip(got, reference)):
            result.rejected["changed the numerics"] = result.rejected.get("changed the numerics", 0) + 1
            return
        ms = timed(cfg)
        result.measured += 1
        if ms < best_ms:
            best, best_ms = cfg, ms

    groups = []
    quack = quack_gemm.unavailable_reason(hidden_states.device) is None
    dims = _gemm_dims(hidden, inter, gated=True, pack=heuristic.pack_gate_up)
    for gemm in GEMMS:
        n_dim, n_factor = dims[gemm]
        cands = gemm_candidates(getattr(heuristic, gemm), n_dim=n_dim, smem_limit=smem_limit,
                                sm_count=props.multi_processor_count, n_factor=n_factor, quack=quack)[1:]
        if gemm == "grad_input":  # in place it writes into a saved buffer, so torch._grouped_mm cannot run it:
            cands = cands[1:]     # the flipped implementation would time the same kernel again (QuACK can)
        groups.append((gemm, _spread(cands, budget)))
    layer = [dict(zip(LAYER_SPACE, v)) for v in itertools.product(*LAYER_SPACE.values())]
    groups.append(("layer", _spread(layer, budget)))
    total = sum(len(c) for _, c in groups)
    done = 0
    for name, cands in groups:
        for cand in cands:
            if name == "layer":
                cfg = dataclasses.replace(best, **cand)
                if cfg == best:
                    done += 1
                    continue
            else:
                cfg = dataclasses.replace(best, **{name: cand})
            consider(name, cfg)
            done += 1
            if progress is not None:
                progress(done, total, best_ms)
    # The winner's time is the least of many noisy measurements: time it and the heuristic again, in
    # alternation, and report those (keeping the heuristic where the winner does not hold up).
    if quack_gemm.failure():  # QuACK went off in this process: what was timed ran without it, so none is kept
        best = best.replace_gemms(quack="")
        result.rejected["QuACK off after a failure"] = 1
    if best != heuristic:
        result.heuristic_ms, best, best_ms = _confirm(heuristic, best, timed)
    result.tuned_ms, result.config = best_ms, best
    result.seconds = time.perf_counter() - started
    return result


# ---- the EP space and tuner ---------------------------------------------------------------------

# OverlapConfig's knobs that the search leaves at their defaults: copy_warps, and copy_back_beside (the copy of the
# forward's result rows beside the work after it: faster in the three interleaved runs of BENCHMARKS.md session
# 23, and searching it would double the candidates); timing is for benchmarks only.
EP_SPACE = {
    "chunks": (1, 2, 4, 8),
    "overlap": (True, False),
    # OverlapConfig.copy_engine (with batch_copies: copy_engine_batches) / copy_kernel
    "transfer": ("copy_engine", "copy_engine_batches", "foreach", "kernel"),
    "copy_programs": (8, 24, 48, 96),  # the transfer kernel's programs beside the GEMMs
    "copy_block": (32768, 8192),  # the elements each of its programs moves at a time
    "copy_streams": (1, 2, 4),  # the copy engines' streams a direction
    "weight_grads_last": (True, False),
    "push_in_gemm": (True, False),  # the chunks' last GEMMs store their results into the peers, or a transfer does
    "taper": (False, True),  # even chunks, or half-size first and last ones
    "push_in_gemm_from": (0, -1),  # every chunk's GEMM pushes, or the last one's only (the transfer kernel the rest)
    "gemm_carveout": (False, True),  # torch._grouped_mm on every SM, or on those the transfer kernel leaves free
}


def ep_candidates(local_experts: int, world: int):
    """Every distinct OverlapConfig of EP_SPACE for ``local_experts`` experts a rank, the default first."""
    from .kernels.triton_transfer import MAX_PEERS

    default = OverlapConfig()
    out, seen = [default], {_ep_schedule(default, local_experts, world)}
    for values in itertools.product(*EP_SPACE.values()):
        knobs = dict(zip(EP_SPACE, values))
        transfer = knobs.pop("transfer")
        if transfer != "kernel":
            if (knobs["copy_programs"], knobs["copy_block"]) != (EP_SPACE["copy_programs"][0],
                                                                 EP_SPACE["copy_block"][0]):
                continue  # only the kernel has programs and blocks
            knobs["copy_programs"], knobs["copy_block"] = default.copy_programs, default.copy_block
        elif world > MAX_PEERS:
            continue
        engine = transfer.startswith("copy_engine")
        if engine or not (knobs["push_in_gemm"] and knobs["overlap"]):
            if knobs["push_in_gemm_from"] != EP_SPACE["push_in_gemm_from"][0]:
                continue  # only the GEMMs' pushes start at a chunk
        if not engine:
            if knobs["copy_streams"] != EP_SPACE["copy_streams"][0]:
                continue  # only the copy engines have streams
            knobs["copy_streams"] = default.copy_streams
        cfg = OverlapConfig(copy_engine=engine, copy_kernel=transfer == "kernel",
                            batch_copies=transfer == "copy_engine_batches", **knobs)
        schedule = _ep_schedule(cfg, local_experts, world)
        if schedule not in seen:  # e.g. more chunks than experts: the same schedule as fewer
            seen.add(schedule)
            out.append(cfg)
    return out


def _ep_schedule(cfg, local_experts: int, world: int) -> tuple:
    """What a config does for this many local experts at this EP size (configs with one schedule are one
    candidate)."""
    chunk, block, engine, batched = cfg.layout_knobs(local_experts, world)
    kernel, pushes = block is not None, cfg.gemm_pushes(local_experts, world)
    return (chunk, cfg.overlap, engine, kernel, (cfg.programs(world), block) if kernel else None,
            min(cfg.copy_streams, world) if engine else None, cfg.weight_grads_last,
            pushes, batched, cfg.first_gemm_push(len(chunk)) if pushes else None,
            cfg.gemm_carveout and kernel and cfg.overlap)


@dataclass
class EPTuneResult:
    key: str
    default_ms: float
    tuned_ms: float
    config: object  # ep.OverlapConfig
    measured: int = 0
    rejected: dict = field(default_factory=dict)
    seconds: float = 0.0


def tune_ep(hidden, topk_ids, topk_weights, w_up, w_down, spec: str, group=None, budget: int = 12,
            iters: int = 10, warmup: int = 3, progress=None, timer=None) -> EPTuneResult:
    """Search EP_SPACE for this rank's layer (call it in every rank of ``group`` with its own shard; see the
    module docstring). ``budget``: at most that many candidates besides the default. ``timer(run) -> ms``:
    by default the median of ``iters`` runs, by CUDA events on CUDA and by the host clock on CPU (where the
    times only exercise the search)."""
    import torch.distributed as dist

    from .ep import ep_experts_overlapped

    started = time.perf_counter()
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, topk_weights, w_up, w_down)]
    grad = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0)).to(hidden.device, hidden.dtype)
    if timer is None:
        timer = (lambda run: time_cuda(run, iters, warmup)) if hidden.is_cuda else \
            (lambda run: time_host(run, iters, warmup))

    def run(cfg):
        for t in leaves:
            t.grad = None
        out = ep_experts_overlapped(leaves[0], topk_ids, leaves[1], leaves[2], leaves[3], None, None, spec, group,
                                    knobs=cfg)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    def slowest(ms: float) -> float:
        t = torch.tensor([ms], dtype=torch.float64, device=hidden.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    def everywhere(ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], device=hidden.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return bool(t.item())

    default = OverlapConfig()
    reference = [t.clone() for t in run(default)]
    best, best_ms = default, slowest(timer(lambda: run(default)))
    result = EPTuneResult(ep_shape_key(hidden, topk_ids, w_up, w_down, spec, world), best_ms, best_ms, default)
    cands = _spread(ep_candidates(w_up.shape[0], world)[1:], budget)
    for i, cfg in enumerate(cands):
        try:
            got, failed = run(cfg), None
        except Exception as exc:  # noqa: BLE001 -- a config the compiler or the device refuses
            got, failed = None, f"failed: {type(exc).__name__}"
        if not everywhere(failed is None):
            reason = failed or "failed on another rank"
            result.rejected[reason] = result.rejected.get(reason, 0) + 1
            continue
        if not everywhere(all(torch.equal(a, b) for a, b in zip(got, reference) if a is not None)):
            result.rejected["changed the numerics"] = result.rejected.get("changed the numerics", 0) + 1
            continue
        ms = slowest(timer(lambda: run(cfg)))
        result.measured += 1
        if ms < best_ms:
            best, best_ms = cfg, ms
        if progress is not None:
            progress(i + 1, len(cands), best_ms)
    if best != default:  # time the winner and the default again (see tune_shape)
        result.default_ms, best, best_ms = _confirm(default, best, lambda cfg: slowest(timer(lambda: run(cfg))))
    result.tuned_ms, result.config = best_ms, best
    result.seconds = time.perf_counter() - started
    return result


def ep_shape_key(hidden, topk_ids, w_up, w_down, spec, world: int) -> str:
    """The cache key of one rank's EP layer: its routed rows times the EP size, all experts, H, I, EP size."""
    return ep_rows_key(hidden.dtype, topk_ids.numel(), hidden.shape[1], w_up, w_down, spec, world)
