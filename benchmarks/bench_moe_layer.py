"""One MoE experts layer, forward + backward, baselines and uniep side by side in one run.

Providers (bf16, HF weight layout [E, 2I, H] / [E, H, I], routing from a softmax-top-k router):
  hf_grouped_mm            HF's default experts implementation, eager
  hf_grouped_mm_inductor   the same module under torch.compile (inductor)
  sort_grouped_mm_inductor the strongest PyTorch-native path: stable sort + torch._grouped_mm + gather combine,
                           under inductor
  liger_fused_moe          Liger-Kernel's Triton fused MoE (if liger_kernel is installed)
  sonicmoe                 SonicMoE's CuTe-DSL MoE (if sonicmoe is installed; see sonicmoe_experts), run only after
                           its output and gradients matched the reference provider's; its GEMMs autotuned over QuACK's
                           whole Hopper space per shape, or at QuACK's default config (--sonicmoe-default-configs)
  sonicmoe_small           the same, its GEMMs autotuned per shape over SONICMOE_SMALL_SPACE (QuACK's default config
                           and the configs that won uniep's GEMMs): a tuned SonicMoE at a fraction of the full
                           space's compile time
  sort_grouped_mm_graphs   sort_grouped_mm_inductor under mode="reduce-overhead" (inductor's CUDA graphs)
  hf_grouped_mm_graphs     hf_grouped_mm_inductor under mode="reduce-overhead"
  uniep                    the same HF module under torch.compile(backend="uniep") (the Triton MegaKernel)
  uniep_graphs             the same under mode="reduce-overhead": the step replayed as CUDA graphs, so a
                           synchronized step does not wait for the host to issue its kernels
  uniep_noquack            the same compiled module with UNIEP_QUACK=0 (the quack knob off: the GEMMs as without
                           quack-kernels), for the knob's A/B in one run
  uniep_quack_entry_point  the same compiled module with UNIEP_QUACK_DIRECT=0 (QuACK's GEMMs launched through its
                           public entry point instead of uniep's direct launch of the same kernels)
  uniep_late_off           the module compiled apart under UNIEP_LATE_ROUTING_WEIGHT=0 (the routing weights applied
                           before the activation-gradient GEMM, the down rows kept for the backward: the numerics
                           knob late_routing_weight off), for its A/B
  uniep_gated              the same compiled module with UNIEP_GATED_EPILOGUE=1 (the numerics knob gated_epilogue
                           on: the SwiGLU and its backward in QuACK's gated and dgated GEMMs' epilogues), for its A/B
  uniep_reference          the same compiled module with UNIEP_KERNELS=reference (the PyTorch reference op)
  uniep_triton             the module compiled apart, run with the heuristics' config for the shape but its GEMMs
                           by Triton (grouped_mm and quack off, scheduling knobs: the same bits; per_expert_mm, a
                           numerics knob, as the heuristics set it)
  uniep_triton_fused       the same with fuse_gather (the token rows gathered inside the GEMMs: no gathered copy)
  uniep_triton_graphs, uniep_triton_fused_graphs   those two under mode="reduce-overhead", each compiled apart

The first provider that runs (hf_grouped_mm unless skipped) is the reference: every other provider's output and
gradients are compared with it (max_rel: max |diff| / max |ref|; rel_err: ||diff|| / ||ref||). A provider named in
VERIFY_BEFORE_TIMING is timed only if every rel_err is under VERIFY_REL_ERR; otherwise the run says so and no time
is recorded for it.

For each: median time of fwd+bwd over --iters runs (CUDA events, the GPU idle before each), the mean over
--iters runs issued back to back (as a training loop issues them), TFLOP/s (fwd 2*T*K*3*H*I, bwd twice that,
over the median), peak memory above the inputs, and whether two runs give bitwise equal output and gradients.

    python benchmarks/bench_moe_layer.py --shapes mixtral,qwen3-30b-a3b,qwen3-30b-a3b@32768 --out results.json

A shape may carry its own token count after "@"; --tokens sets the others.

``--inference``: the forward alone under torch.no_grad() (generate()'s experts call; decode steps are small token
counts: ``--shapes qwen3-30b-a3b@1,qwen3-30b-a3b@64``). Each row then also gives the weight bandwidth: the bytes of
the experts that the routing touches (each read once at least) over the time, ``{provider}_weight_tbps`` (a decode
step's floor is reading them: about 4.8 TB/s on an H200).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

import torch

from uniep_dynamo.tuner import time_cuda  # noqa: F401 (the tuner's timing loop; other benchmarks import it from here)


def time_cuda_back_to_back(step, steps: int) -> float:
    """Mean ms of ``steps`` calls of ``step()`` issued back to back, with no synchronization between them (CUDA
    events around the whole run, as a training loop runs them). One call runs before the first event, so the
    steady state is timed: before 2026-11-27 (fifth session) the first timed call started on an idle GPU, and its
    host time before its first kernel (about 0.6 ms on Qwen3-30B-A3B's layer on an H100) was in the mean too."""
    torch.cuda.synchronize()
    step()  # (not timed: it fills the GPU's queue)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps

SHAPES = {  # name: (hidden H, expert intermediate I, experts E, top-k K)
    "mixtral": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}


def make_inputs(H, I, E, K, T, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, device=device, dtype=dtype, generator=g)
    router = torch.randn(E, H, device=device, dtype=dtype, generator=g) * 0.02
    probs = torch.softmax((x @ router.t()).float(), -1)
    w, ids = torch.topk(probs, K, -1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    grad_out = torch.randn(T, H, device=device, dtype=dtype, generator=g)
    return x, ids, w, grad_out


def hf_experts(H, I, E, K, dtype, device, implementation="grouped_mm"):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = implementation
    torch.manual_seed(0)
    experts = MixtralExperts(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02)
    return experts


def sort_grouped_mm(x, ids, w, w13, w2):
    """Stable sort + torch._grouped_mm + gather combine (fp32 sum over k)."""
    T, K = ids.shape
    E = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.histc(flat.float(), bins=E, min=0, max=E - 1), 0).to(torch.int32)
    xs = x[order // K]
    h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, -1)
    y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    y = y[inv].view(T, K, -1)
    return (y.float() * w.float().unsqueeze(-1)).sum(1).to(x.dtype)


# QuACK's Hopper tile configs that sonicmoe_small tunes over, as (tile_m, tile_n, pingpong, cluster_m, cluster_n):
# QuACK's default (128x192 pingpong, 2x1), the five of uniep's QUACK_SPACE (each won one of uniep's GEMMs on the
# Qwen3-30B-A3B shape: quack_probe.py), and three wide tiles for few large experts. Each GEMM keeps those its
# pruning allows (gathered rows: cluster 1 across N, no 208 columns; the gated epilogues: 32-column multiples).
SONICMOE_SMALL_SPACE = ((128, 192, True, 2, 1), (128, 256, False, 2, 1), (128, 208, True, 1, 2),
                        (192, 128, True, 1, 2), (256, 128, False, 2, 1), (128, 160, True, 2, 1),
                        (256, 192, False, 2, 1), (256, 160, False, 2, 1), (128, 256, False, 1, 2))
SONICMOE_TUNED = ("gemm_tuned", "gemm_act_tuned", "gemm_dact_tuned", "gemm_gated_tuned", "gemm_dgated_tuned")


def sonicmoe_space(space: str) -> dict:
    """{QuACK tuned GEMM name: its candidate configs} for SonicMoE's ``space``: "full" (QuACK's whole list),
    "default" (QuACK's default config alone: no tuning) or "small" (SONICMOE_SMALL_SPACE)."""
    from quack import gemm_interface
    from quack.autotuner import AutotuneConfig

    def key(c):
        return (c.tile_m, c.tile_n, c.pingpong, c.cluster_m, c.cluster_n)

    out = {}
    for name in SONICMOE_TUNED:
        configs = list(getattr(gemm_interface, name).configs)
        if space == "default":
            configs = [AutotuneConfig(config=None)]  # one config: no tuning (what QuACK's tuned=False selects)
        elif space == "small":
            configs = [a for a in configs if a.kwargs["config"] is not None and not a.kwargs["config"].swap_ab
                       and key(a.kwargs["config"]) in SONICMOE_SMALL_SPACE]
        elif space != "full":
            raise ValueError(f"sonicmoe space {space!r}: full, default or small")
        out[name] = configs
    return out


def sonicmoe_experts(experts, space="full"):
    """SonicMoE (sonic-moe 0.1.2, its grouped GEMMs from QuACK's CuTe-DSL kernels) on the HF module's weights and the
    benchmark's routing, through ``sonicmoe.functional.moe_general_routing_inputs``.

    Weight layout: SonicMoE takes w1 as (2I, H, E) with stride order (2, 0, 1), i.e. [E, 2I, H] in memory, and w2 as
    (H, I, E), i.e. [E, H, I] in memory. HF's ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] permuted by
    (1, 2, 0) are exactly that: views, no copy, so its weight gradients land in the HF parameters' ``.grad``.
    Gate/up order: HF's rows are [gate; up] halves (``chunk(2)``), which is SonicMoE's ``concat_layout=True`` (its
    default is gate and up rows interleaved). Activation ``SWIGLU``: silu(gate) * up, as HF's Mixtral experts.
    Routing: the benchmark's top-k as flat (token, expert, weight) triples in token-major order, so the token
    indices are sorted ascending as the function requires; it casts the weights to fp32 itself, and their gradient
    flows back to the bf16 routing weights. (Its fixed-top-k path is reachable only through its own router, which
    would time a different router, so the general-routing path is the one timed.) Its first call JIT-compiles and
    autotunes its GEMMs per shape (QUACK_COMPILE_WORKERS sets the compile processes) over ``space``'s configs
    (sonicmoe_space); "default" runs QuACK's default config for every GEMM, one kernel each.

    The returned function carries ``around``: step() enters it around the forward and the backward, so that the
    QuACK GEMMs SonicMoE calls see this provider's candidate configs and tuning results (each provider keeps its
    own, so two SonicMoE providers share a run); and ``tuned()``: {QuACK GEMM name: {tuning key: chosen config}}.
    Raises ImportError (the caller prints it) where sonicmoe or its CuTe-DSL stack does not import.
    """
    from quack import gemm_interface
    from sonicmoe import moe_general_routing_inputs
    from sonicmoe.enums import ActivationType

    state = {name: (configs, {}) for name, configs in sonicmoe_space(space).items()}

    @contextlib.contextmanager
    def around():
        tuned = {name: getattr(gemm_interface, name) for name in state}
        before = {name: (t.configs, t.cache) for name, t in tuned.items()}
        for name, t in tuned.items():
            t.configs, t.cache = state[name]
        try:
            yield
        finally:
            for name, t in tuned.items():
                t.configs, t.cache = before[name]

    w1 = lambda: experts.gate_up_proj.permute(1, 2, 0)  # noqa: E731 (a view, taken per call so autograd sees it)
    w2 = lambda: experts.down_proj.permute(1, 2, 0)  # noqa: E731
    token_indices = {}  # T -> arange(T) repeated K times: a constant of the shape, built once

    def sonicmoe(x, ids, w):
        T, K = ids.shape
        if (T, K) not in token_indices:
            token_indices[T, K] = torch.arange(T, device=x.device, dtype=torch.int32).repeat_interleave(K)
        out, _ = moe_general_routing_inputs(
            x, w.reshape(-1), token_indices[T, K], ids.reshape(-1).to(torch.int32), w1(), None, w2(), None,
            experts.gate_up_proj.shape[0], torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU,
            concat_layout=True)
        return out

    sonicmoe.around = around
    sonicmoe.tuned = lambda: {name: dict(cache) for name, (_, cache) in state.items() if cache}  # what it chose
    return sonicmoe


VERIFY_BEFORE_TIMING = ("sonicmoe", "sonicmoe_small")
VERIFY_REL_ERR = 2e-2  # ||diff|| / ||ref|| per output and gradient; bf16 operands land between 1e-3 and 1e-2


def providers(experts, sonicmoe_autotune=True):
    out = {}
    out["hf_grouped_mm"] = lambda x, ids, w: experts(x, ids, w)
    compiled = torch.compile(experts)
    out["hf_grouped_mm_inductor"] = lambda x, ids, w: compiled(x, ids, w)
    ref = torch.compile(sort_grouped_mm)
    out["sort_grouped_mm_inductor"] = lambda x, ids, w: ref(x, ids, w, experts.gate_up_proj, experts.down_proj)
    ref_graphs = torch.compile(sort_grouped_mm, mode="reduce-overhead")
    hf_graphs = torch.compile(experts, mode="reduce-overhead")
    out["hf_grouped_mm_graphs"] = lambda x, ids, w: hf_graphs(x, ids, w)
    out["sort_grouped_mm_graphs"] = lambda x, ids, w: ref_graphs(x, ids, w, experts.gate_up_proj, experts.down_proj)
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        out["liger_fused_moe"] = lambda x, ids, w: LigerFusedMoEFunction.apply(
            x, experts.gate_up_proj, experts.down_proj, ids.to(torch.int32), w)
    except Exception as exc:  # noqa: BLE001
        print(f"# liger_fused_moe unavailable: {exc!r}", file=sys.stderr)
    import uniep_dynamo  # noqa: F401

    uniep = torch.compile(experts, backend="uniep")
    out["uniep"] = lambda x, ids, w: uniep(x, ids, w)
    uniep_graphs = torch.compile(experts, backend="uniep", mode="reduce-overhead")
    out["uniep_graphs"] = lambda x, ids, w: uniep_graphs(x, ids, w)

    def with_env(variable, value, compiled=uniep):  # a compiled module with a variable that step() sets around fwd
        def run(x, ids, w):                          # and bwd
            return compiled(x, ids, w)
        run.env = (variable, value)
        return run

    def experts_again(x, ids, w):  # a function of its own: Dynamo's cache entries belong to the code traced first
        return experts(x, ids, w)

    out["uniep_noquack"] = with_env("UNIEP_QUACK", "0")
    out["uniep_quack_entry_point"] = with_env("UNIEP_QUACK_DIRECT", "0")
    # compiled apart: the knob is read while the graph is traced too (whether the backward keeps the down rows)
    out["uniep_late_off"] = with_env("UNIEP_LATE_ROUTING_WEIGHT", "0", torch.compile(experts_again, backend="uniep"))
    out["uniep_gated"] = with_env("UNIEP_GATED_EPILOGUE", "1")
    out["uniep_reference"] = with_env("UNIEP_KERNELS", "reference")

    # every GEMM by Triton (bench_shape sets each one's config for the shape): a function of its own each, so that
    # each keeps its own Dynamo cache entries and CUDA graphs
    def experts_triton(x, ids, w):
        return experts(x, ids, w)

    def experts_triton_fused(x, ids, w):
        return experts(x, ids, w)

    def experts_triton_graphs(x, ids, w):
        return experts(x, ids, w)

    def experts_triton_fused_graphs(x, ids, w):
        return experts(x, ids, w)

    for fn, fused, mode in ((experts_triton, False, None), (experts_triton_fused, True, None),
                            (experts_triton_graphs, False, "reduce-overhead"),
                            (experts_triton_fused_graphs, True, "reduce-overhead")):
        compiled_fn = torch.compile(fn, backend="uniep", mode=mode)

        def run(x, ids, w, compiled_fn=compiled_fn):
            return compiled_fn(x, ids, w)
        run.triton_gemms = fused  # bench_shape: the config (fuse_gather) to run it under
        out["uniep_" + fn.__name__[len("experts_"):]] = run
    try:
        out["sonicmoe"] = sonicmoe_experts(experts, "full" if sonicmoe_autotune else "default")
        out["sonicmoe_small"] = sonicmoe_experts(experts, "small")
    except Exception as exc:  # noqa: BLE001
        print(f"# sonicmoe unavailable: {exc!r}", file=sys.stderr)
    return out


def step(fn, experts, x, ids, w, grad_out, inference=False):
    """One step of ``fn``: forward + backward, returning the output and the gradients; with ``inference`` the forward
    alone under torch.no_grad(), returning the output."""
    def run():
        for p in experts.parameters():
            p.grad = None
        xx = x.detach().requires_grad_()
        ww = w.detach().requires_grad_()
        env = getattr(fn, "env", None)  # (variable, value) for the forward and the backward
        if env is not None:
            before = os.environ.get(env[0])
            os.environ[env[0]] = env[1]
        around = getattr(fn, "around", contextlib.nullcontext)  # a context for the forward and the backward
        try:
            torch.compiler.cudagraph_mark_step_begin()  # a new step for the *_graphs providers' CUDA graphs
            with around():
                if inference:
                    with torch.no_grad():
                        return (fn(x, ids, w),)
                out = fn(xx, ids, ww)
                out.backward(grad_out)
        finally:
            if env is not None:  # the value the user set, if any, back
                if before is None:
                    os.environ.pop(env[0], None)
                else:
                    os.environ[env[0]] = before
        grads = (experts.gate_up_proj.grad, experts.down_proj.grad)
        return (out, xx.grad, ww.grad) + (grads if experts.gate_up_proj.requires_grad else ())
    return run


GRADIENT_NAMES = ("out", "grad_x", "grad_routing_weights", "grad_gate_up_proj", "grad_down_proj")


def to_host(tensors):
    """Copies of a step's output and gradients in host memory: DeepSeek-V3's weight gradients are 22 GB, and a
    reference plus a second copy held on an 80 GB GPU beside the weights and their gradients would not fit."""
    return [t.detach().to("cpu") for t in tensors]


def slices(actual, expected):
    """(actual, expected) one leading slice at a time, both on actual's device (expected may be in host memory)."""
    for a, e in zip(actual.reshape(actual.shape[0], -1), expected.reshape(expected.shape[0], -1)):
        yield a.float(), e.to(a.device, non_blocking=False).float()


def max_rel(actual, expected) -> float:
    """max |a - e| / max |e|, one leading slice at a time (DeepSeek-V3's weight gradients are 14 GB)."""
    diff = scale = 0.0
    for a, e in slices(actual, expected):
        diff = max(diff, (a - e).abs().max().item())
        scale = max(scale, e.abs().max().item())
    return diff / max(scale, 1e-12)


def rel_err(actual, expected) -> float:
    """||a - e|| / ||e|| (Frobenius), one leading slice at a time; NaN anywhere gives NaN."""
    diff = scale = 0.0
    for a, e in slices(actual, expected):
        diff += (a - e).square().sum().item()
        scale += e.square().sum().item()
    return (diff / max(scale, 1e-30)) ** 0.5


def bitwise_equal(actual, expected) -> bool:
    """torch.equal one leading slice at a time, expected possibly in host memory."""
    return all(torch.equal(a, e.to(a.device)) for a, e in zip(actual.reshape(actual.shape[0], -1),
                                                              expected.reshape(expected.shape[0], -1)))


def profile(run, label, rows=25):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(f"# {label}: top CUDA kernels")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def time_provider(row, pname, run, iters, warmup, flops, peak_tflops, peak_back_to_back=None):
    """Time ``run`` (one fwd+bwd step) into ``row``: median ms, back-to-back ms, TFLOP/s, peak memory, bitwise; the
    share of the matmul peak synchronized (``peak_tflops``: the matmul's synchronized median) and back to back
    (``peak_back_to_back``: the matmul back to back, the same regime: the GPU runs slower under sustained load)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = time_cuda(run, iters, warmup)
    row[f"{pname}_peak_mb"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    # the same steps issued back to back, as a training loop runs them (no GPU idle while the host
    # issues a step's first kernels)
    row[f"{pname}_back_to_back_ms"] = round(time_cuda_back_to_back(run, iters), 3)
    a = to_host(run())
    row[f"{pname}_bitwise"] = all(bitwise_equal(p, q) for p, q in zip(run(), a))
    row[f"{pname}_ms"] = round(ms, 3)
    row[f"{pname}_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
    if peak_tflops:
        row[f"{pname}_pct_peak"] = round(100 * row[f"{pname}_tflops"] / peak_tflops, 1)
    if peak_back_to_back:
        row[f"{pname}_pct_peak_back_to_back"] = round(
            100 * flops / (row[f"{pname}_back_to_back_ms"] * 1e-3) / 1e12 / peak_back_to_back, 1)


def bench_shape(name, T, iters, warmup, dtype, device, skip=(), profile_providers=(), peak_tflops=None,
                sonicmoe_autotune=True, frozen_experts=False, peak_back_to_back=None, inference=False):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # no automatic-dynamic carry-over from the previous shape
    counters.clear()
    H, I, E, K = SHAPES[name]
    experts = hf_experts(H, I, E, K, dtype, device)
    for p in experts.parameters():  # --frozen-experts: no weight gradients (LoRA fine-tuning), 2 GEMMs of 6 fewer
        p.requires_grad_(not frozen_experts)
    x, ids, w, grad_out = make_inputs(H, I, E, K, T, dtype, device)
    flops = (1 if inference else 2 if frozen_experts else 3) * 2 * T * K * 3 * H * I
    row = {"shape": name if T == 8192 else f"{name}@{T}", "T": T, "H": H, "I": I, "E": E, "K": K,
           "dtype": str(dtype).replace("torch.", ""), "frozen_experts": frozen_experts, "inference": inference}
    # the experts the routing touches: their weights ([2I, H] and [H, I] each) are read at least once a forward
    row["experts_touched"] = int(torch.unique(ids).numel())
    weight_bytes = row["experts_touched"] * 3 * H * I * torch.finfo(dtype).bits // 8
    reference = None
    for pname, fn in providers(experts, sonicmoe_autotune).items():
        if pname in skip:
            continue
        print(f"# {time.strftime('%H:%M:%S')} {row['shape']} {pname}", flush=True)
        counters["uniep_kernels"].clear()
        if hasattr(fn, "triton_gemms"):  # the heuristics' config for this shape with every GEMM by Triton
            from uniep_dynamo.kernels import config as kconfig

            cfg = kconfig.heuristic_config(T * K, E, H, I).replace_gemms(grouped_mm=False, quack="")
            cfg = dataclasses.replace(cfg, fuse_gather=fn.triton_gemms)
            fn.around = lambda cfg=cfg: kconfig.use_config(cfg)
        try:
            run = step(fn, experts, x, ids, w, grad_out, inference)
            t0 = time.time()
            first = run()  # compile
            row[f"{pname}_first_call_s"] = round(time.time() - t0, 2)
            print(f"#   first call {row[f'{pname}_first_call_s']} s", flush=True)
            if reference is None:
                reference = to_host(first)
                row["reference"] = pname
            else:
                errs = [rel_err(p, q) for p, q in zip(first, reference)]
                row[f"{pname}_rel_err"] = dict(zip(GRADIENT_NAMES, (round(e, 5) for e in errs)))
                row[f"{pname}_max_rel_vs_hf"] = round(max(max_rel(p, q) for p, q in zip(first, reference)), 4)
                if pname in VERIFY_BEFORE_TIMING:
                    row[f"{pname}_verified"] = all(e < VERIFY_REL_ERR for e in errs)  # False on NaN too
                    print(f"# {row['shape']} {pname} against {row['reference']}: rel_err "
                          f"{row[f'{pname}_rel_err']}, max_rel {row[f'{pname}_max_rel_vs_hf']} -> "
                          f"{'verified' if row[f'{pname}_verified'] else 'FAILED verification, not timed'}",
                          flush=True)
            verified = row.get(f"{pname}_verified", True)
            del first
            if verified:
                time_provider(row, pname, run, iters, warmup, flops, peak_tflops, peak_back_to_back)
                if inference:
                    row[f"{pname}_weight_tbps"] = round(weight_bytes / (row[f"{pname}_ms"] * 1e-3) / 1e12, 3)
                print(f"#   {row[f'{pname}_ms']} ms, bitwise {row[f'{pname}_bitwise']}", flush=True)
                if pname == "uniep":
                    row["uniep_rewrites"] = counters["uniep"]["moe_experts"]
                if pname.startswith("uniep"):  # QuACK's GEMMs over this provider's steps: whether the knob ran
                    row[f"{pname}_quack_gemms"] = counters["uniep_kernels"]["quack_gemms"]
                if pname in profile_providers:
                    profile(run, f"{name} {pname}")
        except Exception as exc:  # noqa: BLE001
            row[pname] = "ERR " + repr(exc)[:300]
            print(f"# {row['shape']} {pname}: {row[pname]}", flush=True)
        for p in experts.parameters():
            p.grad = None
        torch.cuda.empty_cache()
    return row


def print_table(rows):
    names = [k[:-3] for k in rows[0] if k.endswith("_ms") and not k.endswith("_back_to_back_ms")] if rows else []
    print("ms synchronized per step (back to back), TFLOP/s of the synchronized time (--inference: TB/s of the "
          "touched experts' weights)")
    print(f"{'shape':16s} " + " ".join(f"{n:>36s}" for n in names))
    for row in rows:
        cells = []
        for n in names:
            ms, b2b = row.get(f"{n}_ms"), row.get(f"{n}_back_to_back_ms")
            rate = f"{row[f'{n}_weight_tbps']:6.3f} TB/s" if f"{n}_weight_tbps" in row else \
                f"{row.get(f'{n}_tflops', 0):6.1f} TF/s"
            cells.append(f"{ms:9.3f} ({b2b:9.3f}) ms {rate}" if isinstance(ms, float) and isinstance(b2b, float)
                         else "ERR")
        print(f"{row['shape']:16s} " + " ".join(f"{c:>36s}" for c in cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip", default="", help="providers to leave out, comma separated")
    parser.add_argument("--profile", default="", help="providers to profile (top CUDA kernels), comma separated")
    parser.add_argument("--frozen-experts", action="store_true",
                        help="the expert weights need no gradient (LoRA fine-tuning): fwd + the input and routing-"
                             "weight gradients, 4 GEMMs of the 6 (TFLOP/s counts those)")
    parser.add_argument("--inference", action="store_true",
                        help="the forward alone under torch.no_grad() (generate()'s experts call); rows add the "
                             "weight bandwidth of the experts the routing touches")
    parser.add_argument("--sonicmoe-default-configs", action="store_true",
                        help="run SonicMoE's GEMMs at QuACK's default config instead of autotuning them per shape "
                             "(its autotuning of Qwen3-30B-A3B's first shape outlasted a 560 s call on an H200 on "
                             "2026-11-27: give it a call of its own, or take this flag)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_moe_layer.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe_layer: needs a CUDA GPU")
    device, dtype = "cuda", torch.bfloat16
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    peak_ms = time_cuda(lambda: a @ a, 50, 25)  # 25 warm-ups: the clocks rise from idle first
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "bf16_matmul_tflops": round(2 * 8192**3 / (peak_ms * 1e-3) / 1e12, 1),
            # the same matmul 100 times back to back: the yardstick of the back-to-back steps (under sustained load
            # the GPU runs slower: 679-687 TF/s against 664-723 synchronized and 759-783 from a full queue on the
            # H200s of 2026-11-27, queued_step_probe.py)
            "bf16_matmul_tflops_back_to_back": round(
                2 * 8192**3 / (time_cuda_back_to_back(lambda: a @ a, 100) * 1e-3) / 1e12, 1)}
    from importlib import metadata

    for package in ("transformers", "triton", "liger-kernel", "sonic-moe", "quack-kernels", "nvidia-cutlass-dsl"):
        try:
            meta[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    meta["sonicmoe_autotune"] = not args.sonicmoe_default_configs
    meta["env"] = {k: os.environ[k] for k in ("LIGER_FUSED_MOE_AUTOTUNE", "QUACK_COMPILE_WORKERS") if k in os.environ}
    print(json.dumps(meta))
    rows = []
    for spec in args.shapes.split(","):
        name, _, tokens = spec.partition("@")
        row = bench_shape(name, int(tokens or args.tokens), args.iters, args.warmup, dtype, device,
                          skip=tuple(filter(None, args.skip.split(","))),
                          profile_providers=tuple(filter(None, args.profile.split(","))),
                          peak_tflops=meta["bf16_matmul_tflops"],
                          peak_back_to_back=meta["bf16_matmul_tflops_back_to_back"],
                          sonicmoe_autotune=not args.sonicmoe_default_configs, frozen_experts=args.frozen_experts,
                          inference=args.inference)
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(args.out, "w") as f:  # after every shape: a run stopped at its time limit keeps what it measured
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print_table(rows)


if __name__ == "__main__":
    main()
