"""GPU checks of the Triton MegaKernel (marked `gpu`): bf16 against an fp64 reference, bitwise
reproducibility over 20 runs and across every scheduling knob, CUDA-graph capture (no host sync)."""
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import TOLERANCE, assert_routing_plan_equals_reference, max_rel_err
from test_reference import GELU_GLU, GELU_TANH_GLU, GPT_OSS, RELU2, SILU_GLU, make
from uniep_dynamo.kernels import config as kconfig
from uniep_dynamo.spec import ExpertsSpec

pytestmark = pytest.mark.gpu


def cuda_args(T, H, I, E, K, gate=SILU_GLU, layout="oi", bias=False, dtype=torch.bfloat16, skew=False):
    args = make(T, H, I, E, K, gate, layout, bias, dtype=torch.float32)
    hidden, ids, weights, w_up, w_down, b_up, b_down, _ = args
    if skew:  # a hot expert and idle ones, like a badly balanced router
        ids = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(5)) < 0.5, 0, ids)
        ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 1] + 1) % E, ids[:, 1])
    if gate == GPT_OSS:
        hidden = hidden * 10  # past the clamp limit on both sides
    to = lambda t: t.to(device="cuda", dtype=dtype) if t is not None else None  # noqa: E731
    return (to(hidden), ids.cuda(), to(weights), to(w_up), to(w_down), to(b_up), to(b_down),
            ExpertsSpec(layout, layout, gate, dtype))


def fwd_bwd(args, grad_seed=0, dtype=None):
    hidden, ids, weights, w_up, w_down, b_up, b_down, spec = args
    if dtype is not None:
        spec = dataclasses.replace(spec, out_dtype=dtype)
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    leaves = [cast(t).detach().clone().requires_grad_() if t is not None else None
              for t in (hidden, weights, w_up, w_down, b_up, b_down)]
    out = torch.ops.uniep.moe_experts(leaves[0], ids, *leaves[1:], [], spec.encode())[0]
    g = torch.Generator(device="cuda").manual_seed(grad_seed)
    out.backward(torch.randn(out.shape, device="cuda", generator=g).to(out.dtype))
    return [out] + [t.grad for t in leaves if t is not None]


CASES = [
    # (T, H, I, E, K, gate, layout, bias)
    (1000, 512, 1024, 8, 2, SILU_GLU, "oi", False),     # Mixtral-like, several row tiles per expert
    (777, 256, 192, 64, 8, SILU_GLU, "oi", False),      # Qwen3/OLMoE-like: many small experts, odd T
    (300, 256, 128, 256, 8, SILU_GLU, "io", False),     # E=256 (DeepSeek-V3), most experts nearly idle
    (500, 384, 256, 8, 2, GPT_OSS, "io", True),         # GPT-OSS gate with biases
    (400, 256, 256, 8, 2, GELU_GLU, "oi", False),
    (400, 256, 256, 8, 2, GELU_TANH_GLU, "io", False),
    (400, 256, 320, 8, 2, RELU2, "oi", False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_fused_against_fp64_reference(case, dtype, monkeypatch):
    args = cuda_args(*case, dtype=dtype)
    monkeypatch.setenv("UNIEP_KERNELS", "auto")
    counters.clear()
    fused = fwd_bwd(args)
    assert counters["uniep_kernels"]["triton_forward"] == 1 and counters["uniep_kernels"]["triton_backward"] == 1
    exact = fwd_bwd(args, dtype=torch.float64)  # the reference op in float64 on the same inputs
    bf16_ref = None
    monkeypatch.setenv("UNIEP_KERNELS", "reference")
    bf16_ref = fwd_bwd(args)  # the reference op in the same dtype: how far plain bf16/fp16 GEMMs land
    for i, (a, b, r) in enumerate(zip(fused, exact, bf16_ref)):
        err, ref_err = max_rel_err(a, b), max_rel_err(r, b)
        assert err <= max(TOLERANCE[dtype], 2 * ref_err), f"tensor {i}: fused {err:.3g}, reference {ref_err:.3g}"


def test_twenty_runs_bitwise_identical():
    args = cuda_args(2000, 512, 768, 16, 4, skew=True)
    first = fwd_bwd(args)
    for _ in range(19):
        assert all(torch.equal(a, b) for a, b in zip(first, fwd_bwd(args)))


SWEEP = [("block_m", v) for v in (64, 128)] + [("block_n", v) for v in (64, 128)] + \
        [("num_warps", v) for v in (4, 8)] + [("num_stages", v) for v in (2, 3, 4)] + \
        [("group_m", v) for v in (1, 4, 16)] + [("num_programs", v) for v in (0, 132, 264)] + \
        [("fuse_gather", v) for v in (True, False)] + [("pack_gate_up", v) for v in (True, False)] + \
        [("tma", v) for v in (True, False)] + [("tma_weight_grad", v) for v in (True, False)] + \
        [("loops", dict(num_programs=132, flatten=f, warp_specialize=w)) for f in (True, False) for w in (True, False)] + \
        [("grouped_mm", True), ("grouped_mm_in_place", True)]


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=["qwen_like", "e256_io", "gpt_oss_bias"])
def test_scheduling_knobs_are_bitwise_neutral(case, monkeypatch):
    """Every value of every knob but block_k gives the same bits (config.py's numerics contract), torch._grouped_mm
    for the GEMMs included (it must really run: a spy counts its calls)."""
    args = cuda_args(*case)
    # Triton for every GEMM, so that the tile knobs below are exercised
    base = kconfig.heuristic_config(case[0] * case[4], case[3], case[1], case[2]).replace_gemms(grouped_mm=False,
                                                                                                 quack="")
    with kconfig.use_config(base):
        expected = fwd_bwd(args)
    calls = []
    inner = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or inner(*a, **k))
    for knob, value in SWEEP:
        run_args = args
        if knob == "loops":
            cfg = base.replace_gemms(**value)
        elif knob in kconfig.LAYER_SCHEDULING_KNOBS:
            cfg = dataclasses.replace(base, **{knob: value})
        elif knob.startswith("grouped_mm"):
            cfg = base.replace_gemms(grouped_mm=value)
            if knob == "grouped_mm_in_place":
                run_args = args[:7] + (dataclasses.replace(args[7], reuse_saved=True),)
        else:
            cfg = base.replace_gemms(**{knob: value})
        calls.clear()
        with kconfig.use_config(cfg):
            got = fwd_bwd(run_args)
        if knob.startswith("grouped_mm"):  # every GEMM, but those with a bias and grad_input in place
            assert len(calls) == (2 if case[7] else 6) - (knob == "grouped_mm_in_place"), knob
        for i, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a, b), f"{knob}={value} changed tensor {i}"


QUACK_SWEEP = {"heuristic": kconfig.QUACK_CONFIGS,  # each GEMM its own; the up projection's two gather
               "late": kconfig.QUACK_CONFIGS,  # the same under late_routing_weight (the output-gradient rows unweighted)
               "late_gathering": "128x192/pingpong/2x1",  # under it, every GEMM that reads token rows gathers them
               "default": "128x192/pingpong/2x1",  # QuACK's default config, gathering
               "cluster_n2": "192x128/pingpong/1x2"}  # cannot gather: the gathered GEMMs read materialized rows


@pytest.mark.parametrize("sweep", list(QUACK_SWEEP))
@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=["qwen_like", "e256_io", "gpt_oss_bias"])
def test_quack_gemms_are_bitwise_neutral(case, in_place, sweep):
    """The quack knob (QuACK's grouped GEMMs, its row gathers included) gives the Triton GEMMs' bits, in every GEMM it
    can take (a spy counts them: all six, or the two without a bias), with its tile configs, in place or not."""
    from uniep_dynamo.kernels import quack_gemm

    reason = quack_gemm.unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"QuACK does not run here: {reason}")
    args = cuda_args(*case)
    if in_place:
        args = args[:7] + (dataclasses.replace(args[7], reuse_saved=True),)
    base = kconfig.heuristic_config(case[0] * case[4], case[3], case[1], case[2]).replace_gemms(grouped_mm=False,
                                                                                                 quack="")
    if sweep.startswith("late"):
        base = dataclasses.replace(base, late_routing_weight=True)
    with kconfig.use_config(base):
        expected = fwd_bwd(args)
    configs = QUACK_SWEEP[sweep]
    per_gemm = configs if isinstance(configs, dict) else dict.fromkeys(kconfig.GEMMS, configs)
    cfg = dataclasses.replace(base, **{g: dataclasses.replace(getattr(base, g), quack=per_gemm[g])
                                       for g in kconfig.GEMMS})
    counters.clear()
    with kconfig.use_config(cfg):
        got = fwd_bwd(args)
        again = fwd_bwd(args)
    assert counters["uniep_kernels"]["quack_gemms"] == 2 * (2 if case[7] else 6)
    for i, (a, b, c) in enumerate(zip(got, expected, again)):
        assert torch.equal(a, b) and torch.equal(a, c), f"quack {sweep} changed tensor {i}"


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def run_expert_runs(x, w_up, w_down, spec, cfg, counts, runs, lead: bool):
    """The EP device plan pipeline's chunk GEMMs (device_pipeline.forward's up and down, its backward's activation
    gradient) over runs of experts [e0, e1) of a buffer in expert order (``counts``: each expert's rows), into
    buffers filled with NaN first: (up, act, down, grad_act). Each run must leave every row outside its own unchanged
    (checked after it). ``lead`` False: one run over every expert (``runs`` ignored)."""
    from uniep_dynamo.kernels import megakernel
    from uniep_dynamo.kernels.triton_gemm import GLU_FWD, STORE

    capacity, size = x.shape
    inter = w_down.shape[2]
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    ends = torch.tensor(starts[1:], device=x.device)
    out = [torch.full((capacity, n), float("nan"), dtype=x.dtype, device=x.device)
           for n in (2 * inter, inter, size, inter)]
    up, act, down, d_act = out
    for e0, e1 in (runs if lead else [(0, w_up.shape[0])]):
        before = [t.clone() for t in out]
        layer = megakernel.Layer(x, (capacity, 1), w_up[e0:e1], w_down[e0:e1], spec, cfg)
        offsets, first = ends[e0:e1], lead and e0 > 0
        megakernel.rows_gemm(layer, cfg.up, a=x, gather=False, row_order=None, b=layer.up_eff, n=layer.inter,
                             k=size, epilogue=GLU_FWD, c=up, d=act, offsets=offsets, lead=first,
                             **layer.weight_halves())
        megakernel.rows_gemm(layer, cfg.down, a=act, gather=False, row_order=None, b=layer.down_eff, n=size,
                             k=layer.inter, epilogue=STORE, c=down, offsets=offsets, lead=first)
        megakernel.rows_gemm(layer, cfg.grad_act, a=x, gather=False, row_order=None,
                             b=layer.down_eff.transpose(1, 2), n=layer.inter, k=size, epilogue=STORE, c=d_act,
                             offsets=offsets, lead=first)
        lo, hi = starts[e0], starts[e1]
        for name, t, b in zip(("up", "act", "down", "grad_act"), out, before):
            assert torch.equal(_bits(t[:lo]), _bits(b[:lo])) and torch.equal(_bits(t[hi:]), _bits(b[hi:])), \
                f"{name}: the run of experts {e0}-{e1} wrote rows outside its own ({lo}-{hi})"
    return out


def test_quack_over_runs_of_experts_past_row_0():
    """rows_gemm's ``lead`` by QuACK (the EP device plan pipeline's chunk GEMMs): each run of experts past row 0
    writes its rows only (rows past the routed end and none of another run's), with the bits of the same GEMMs over
    every expert at once, by QuACK and by Triton; an expert with no rows and a run of one expert included."""
    from uniep_dynamo.kernels import quack_gemm

    reason = quack_gemm.unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"QuACK does not run here: {reason}")
    E, H, I = 8, 512, 384
    counts = [500, 0, 130, 700, 1, 400, 269, 1000]
    capacity = sum(counts) + 77  # rows past the routed end stay NaN
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(capacity, H, device="cuda", generator=g).bfloat16()
    w_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.05).bfloat16()
    w_down = (torch.randn(E, H, I, device="cuda", generator=g) * 0.05).bfloat16()
    spec = ExpertsSpec("oi", "oi", SILU_GLU, torch.bfloat16)
    triton = kconfig.heuristic_config(capacity, E, H, I).replace_gemms(grouped_mm=False, per_expert_mm=False,
                                                                       quack="")
    quack = dataclasses.replace(triton, **{g: dataclasses.replace(getattr(triton, g), quack=kconfig.QUACK_CONFIGS[g])
                                           for g in kconfig.GEMMS})
    runs = [(0, 3), (3, 4), (4, 8)]
    counters.clear()
    whole = run_expert_runs(x, w_up, w_down, spec, triton, counts, runs, lead=False)
    by_quack = run_expert_runs(x, w_up, w_down, spec, quack, counts, runs, lead=True)
    assert counters["uniep_kernels"]["quack_gemms"] == 3 * len(runs) and quack_gemm.failure() is None
    routed = sum(counts)
    for name, a, b in zip(("up", "act", "down", "grad_act"), by_quack, whole):
        assert torch.equal(a[:routed], b[:routed]), f"{name}: QuACK by runs differs from Triton over every expert"
        assert a[routed:].isnan().all() and b[routed:].isnan().all(), f"{name}: rows past the routed end written"
    by_triton = run_expert_runs(x, w_up, w_down, spec, triton, counts, runs, lead=True)
    for name, a, b in zip(("up", "act", "down", "grad_act"), by_triton, whole):
        assert torch.equal(a[:routed], b[:routed]) and a[routed:].isnan().all(), name


def _gated_configs(case, late: bool):
    """(knob off, gated_epilogue on) over QuACK's configs for every GEMM, for a CASES shape."""
    base = kconfig.heuristic_config(case[0] * case[4], case[3], case[1], case[2]).replace_gemms(grouped_mm=False)
    base = dataclasses.replace(base, late_routing_weight=late, **{
        g: dataclasses.replace(getattr(base, g), quack=kconfig.QUACK_CONFIGS[g]) for g in kconfig.GEMMS})
    return dataclasses.replace(base, gated_epilogue=False), kconfig.gated_config(base)


@pytest.mark.parametrize("late", [True, False], ids=["late_weight", "weighted_rows"])
@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
def test_gated_epilogue_by_quack(in_place, late, monkeypatch):
    """config.gated_epilogue on a GPU with QuACK: the up projection is one gated GEMM and the backward's two GEMMs
    over d_h read the weight's halves interleaved (all six GEMMs by QuACK, no copy between the layouts); against the
    fp64 reference within bf16's tolerance, bitwise run to run and across QuACK tile configs (a scheduling knob), and
    other bits than the knob off (a numerics knob)."""
    from uniep_dynamo.kernels import megakernel, quack_gemm

    reason = quack_gemm.unavailable_reason(torch.device("cuda"))
    if reason is not None or quack_gemm._gated_entry() is None:
        pytest.skip(f"QuACK's gated GEMM does not run here: {reason or 'no gemm_gated taking concat_layout'}")
    case = CASES[1]
    args = cuda_args(*case)
    if in_place:
        args = args[:7] + (dataclasses.replace(args[7], reuse_saved=True),)
    off, on = _gated_configs(case, late)
    with kconfig.use_config(off):
        knob_off = fwd_bwd(args)
    copies = []
    for name in ("_interleave", "_deinterleave"):
        monkeypatch.setattr(megakernel, name, lambda *a, _n=name, _f=getattr(megakernel, name): copies.append(_n)
                            or _f(*a))
    dgated = []  # under late_routing_weight the activation backward is in the activation-gradient GEMM's epilogue
    monkeypatch.setattr(quack_gemm, "dgated", lambda *a, _f=quack_gemm.dgated, **k: dgated.append(1) or _f(*a, **k))
    counters.clear()
    with kconfig.use_config(on):
        got = fwd_bwd(args)
        again = fwd_bwd(args)
    other = on.replace_gemms(quack="128x192/pingpong/2x1")  # the dgated GEMM's tile kept: its width is numerics
    with kconfig.use_config(dataclasses.replace(other, grad_act=on.grad_act)):
        other_tiles = fwd_bwd(args)
    assert counters["uniep_kernels"]["quack_gemms"] == 3 * 6 and not copies, copies
    assert quack_gemm.failure() is None and len(dgated) == (3 if late else 0), dgated
    if in_place:  # d_h written over h (QuACK's dgated reads h and writes d_h in one epilogue): the out-of-place bits
        with kconfig.use_config(on):
            saved = fwd_bwd(args[:7] + (dataclasses.replace(args[7], reuse_saved=False),))
        for i, (a, b) in enumerate(zip(got, saved)):
            assert torch.equal(a, b), f"tensor {i}: in place differs from out of place"
    ref = fwd_bwd(args, dtype=torch.float64)
    for i, (a, b, c, r) in enumerate(zip(got, again, other_tiles, ref)):
        assert torch.equal(a, b) and torch.equal(a, c), f"tensor {i} moved run to run or with the tiles"
        err = max_rel_err(a, r)
        assert err < TOLERANCE[torch.bfloat16], f"tensor {i}: max rel err {err:.3g} against fp64"
    assert not torch.equal(got[0], knob_off[0]), "the activation from the fp32 accumulator: other bits"


@pytest.mark.parametrize("quack", [False, True], ids=["triton_gemms", "quack"])
@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
def test_frozen_experts_skip_two_gemms_and_keep_the_other_bits(in_place, quack):
    """Frozen experts (LoRA fine-tuning): the backward runs two GEMMs, not four (no weight gradient), and d_hidden
    and d_weights are those of trainable experts bit for bit; with QuACK on every GEMM it counts 2 + 2."""
    from uniep_dynamo.kernels import quack_gemm

    if quack and quack_gemm.unavailable_reason(torch.device("cuda")) is not None:
        pytest.skip(f"QuACK does not run here: {quack_gemm.unavailable_reason(torch.device('cuda'))}")
    case = CASES[1]
    args = cuda_args(*case)
    if in_place:
        args = args[:7] + (dataclasses.replace(args[7], reuse_saved=True),)
    base = kconfig.heuristic_config(case[0] * case[4], case[3], case[1], case[2]).replace_gemms(grouped_mm=False,
                                                                                                 quack="")
    cfg = dataclasses.replace(base, **{g: dataclasses.replace(getattr(base, g), quack=kconfig.QUACK_CONFIGS[g])
                                       for g in kconfig.GEMMS}) if quack else base
    hidden, ids, weights, w_up, w_down, _, _, spec = args
    with kconfig.use_config(cfg):
        expected = fwd_bwd(args)
        counters.clear()
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weights)]
        out = torch.ops.uniep.moe_experts(leaves[0], ids, leaves[1], w_up, w_down, None, None, [], spec.encode())[0]
        g = torch.Generator(device="cuda").manual_seed(0)
        out.backward(torch.randn(out.shape, device="cuda", generator=g).to(out.dtype))
    if quack:
        assert counters["uniep_kernels"]["quack_gemms"] == 2 + 2
    for name, a, b in zip(("out", "d_hidden", "d_weights"), [out, leaves[0].grad, leaves[1].grad], expected):
        assert torch.equal(a, b), name


def _quack_direct_or_skip():
    """kernels/quack_gemm.py, where QuACK runs here and its direct launch serves; else the test is skipped, saying why."""
    from uniep_dynamo.kernels import quack_gemm

    reason = quack_gemm.unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"QuACK does not run here: {reason}")
    if quack_gemm._direct_parts() is None:
        pytest.skip("this QuACK release is not the one the direct launch was written against")
    return quack_gemm


def test_quack_direct_launch_matches_its_entry_point(monkeypatch):
    """uniep's direct launch of QuACK's compiled GEMMs (kernels/quack_gemm.py) gives the bits of QuACK's public entry
    point, in the forward and the backward, the gathered GEMMs included; a spy shows each path ran."""
    quack_gemm = _quack_direct_or_skip()
    case = CASES[1]
    args = cuda_args(*case)
    cfg = kconfig.heuristic_config(case[0] * case[4], case[3], case[1], case[2])
    cfg = dataclasses.replace(cfg, **{g: dataclasses.replace(getattr(cfg, g), quack=kconfig.QUACK_CONFIGS[g])
                                      for g in kconfig.GEMMS})
    direct = quack_gemm._direct
    ran = []
    monkeypatch.setattr(quack_gemm, "_direct", lambda *a, **k: ran.append(direct(*a, **k)) or ran[-1])
    with kconfig.use_config(cfg):
        monkeypatch.setenv("UNIEP_QUACK_DIRECT", "0")
        entry = fwd_bwd(args)
        assert ran and not any(ran)
        ran.clear()
        monkeypatch.setenv("UNIEP_QUACK_DIRECT", "1")
        got = fwd_bwd(args)
        assert len(ran) == 6 and all(ran)
    for i, (a, b) in enumerate(zip(got, entry)):
        assert torch.equal(a, b), f"the direct launch changed tensor {i}"


def test_forward_and_backward_capture_in_a_cuda_graph():
    """No host synchronisation anywhere: both ops record into a CUDA graph and replay correctly."""
    hidden, ids, weights, w_up, w_down, _, _, spec = cuda_args(600, 256, 256, 16, 4)
    grad = torch.randn(600, 256, device="cuda", dtype=torch.bfloat16)

    def step():
        out, *plan = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], spec.encode())
        grads = torch.ops.uniep.moe_experts_backward(grad, hidden, ids, weights, w_up, w_down, None, None, [],
                                                     *plan, spec.encode())
        return out, grads[0], grads[2]

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    ids.copy_(torch.roll(ids, 1, 0))  # new routing, same buffers
    graph.replay()
    fresh = step()
    for a, b in zip(captured, fresh):
        assert torch.equal(a, b)
    assert not torch.equal(captured[0], eager[0])


@pytest.mark.parametrize("warm, gated", [(True, False), (False, False), (True, True)],
                         ids=["launched_before", "not_launched_before", "gated_epilogue"])
def test_quack_gemms_record_into_a_cuda_graph(warm, gated, monkeypatch):
    """QuACK's GEMMs launched before a capture record into a CUDA graph (all six, gathers included) and replay the
    Triton GEMMs' bits; one never launched before takes the other GEMMs for that call (no compile inside the capture),
    with the same bits, and the knob stays on."""
    quack_gemm = _quack_direct_or_skip()
    case = CASES[1]
    hidden, ids, weights, w_up, w_down, _, _, spec = cuda_args(*case)
    grad = torch.randn(hidden.shape, device="cuda", dtype=torch.bfloat16)
    base = kconfig.heuristic_config(case[0] * case[4], case[3], case[1], case[2]).replace_gemms(grouped_mm=False,
                                                                                                 quack="")
    cfg = dataclasses.replace(base, **{g: dataclasses.replace(getattr(base, g), quack=kconfig.QUACK_CONFIGS[g])
                                       for g in kconfig.GEMMS})
    if gated:  # the numerics knob: its own bits, which the eager steps before the capture give
        base = cfg = dataclasses.replace(cfg, gated_epilogue=True)

    def step():
        out, *plan = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], spec.encode())
        grads = torch.ops.uniep.moe_experts_backward(grad, hidden, ids, weights, w_up, w_down, None, None, [],
                                                     *plan, spec.encode())
        return (out,) + tuple(g for g in grads if isinstance(g, torch.Tensor) and g.numel())

    with kconfig.use_config(base):
        expected = [t.clone() for t in step()]  # the Triton GEMMs (compiled here, outside the capture)
    with kconfig.use_config(cfg):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # QuACK's kernels launched once outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        if not warm:
            monkeypatch.setattr(quack_gemm, "_LAUNCHERS", {})
        counters.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        assert counters["uniep_kernels"]["quack_gemms"] == (6 if warm else 0)
        assert quack_gemm.failure() is None
    for t in captured:
        t.zero_()
    graph.replay()
    for i, (a, b) in enumerate(zip(captured, expected)):
        assert torch.equal(a, b), f"tensor {i}"


@pytest.mark.parametrize("slots", [1, 3, 16, 31, 100, 128, 1000, 1024, 1025, 5000])
def test_routing_plan_on_the_gpu_equals_reference(slots):
    """The routing plan's kernels on a GPU at every size class: the one-launch plan of <= 1024 slots at sort widths
    smaller than a program's threads (the interpreter runs tl.histogram and tl.sort on as many lanes as asked, a GPU
    spreads them over its warps), and the three-launch plan past it; clamped and not, ids out of range both ways,
    int64 ids past int32's range."""
    g = torch.Generator().manual_seed(slots)
    ids = torch.randint(-2, 70, (slots,), generator=g)
    if slots >= 3:
        ids[:2] = torch.tensor([2**32 + 1, -(2**31) - 5])
    assert_routing_plan_equals_reference(ids.cuda(), 64)


@pytest.mark.parametrize("reuse_saved", [False, True], ids=["out_of_place", "in_place"])
def test_per_expert_mm_matches_the_grouped_gemms_bits(reuse_saved, monkeypatch):
    """per_expert_mm (one cuBLAS matmul per expert) on every GEMM of a Mixtral-like layer with an idle expert: close
    to the fp64 reference, bitwise run to run, and on Hopper bitwise equal to torch._grouped_mm's (config.py
    calls it a numerics knob, since cuBLAS picks its kernel; this holds what was measured for such shapes)."""
    args = list(cuda_args(3000, 512, 1024, 8, 2, skew=True))
    args[7] = dataclasses.replace(args[7], reuse_saved=reuse_saved)
    base = kconfig.heuristic_config(6000, 8, 512, 1024)
    counters.clear()
    with kconfig.use_config(base.replace_gemms(per_expert_mm=True)):
        got = fwd_bwd(args)
        again = fwd_bwd(args)
    assert counters["uniep_kernels"]["per_expert_mm_gemms"] == 12
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    exact = fwd_bwd(args, dtype=torch.float64)
    monkeypatch.setenv("UNIEP_KERNELS", "reference")
    ref = fwd_bwd(args)
    monkeypatch.setenv("UNIEP_KERNELS", "auto")
    for i, (a, b, r) in enumerate(zip(got, exact, ref)):
        err, ref_err = max_rel_err(a, b), max_rel_err(r, b)
        assert err <= max(TOLERANCE[torch.bfloat16], 2 * ref_err), f"tensor {i}: {err:.3g} (reference {ref_err:.3g})"
    if torch.cuda.get_device_capability(0)[0] == 9:
        with kconfig.use_config(base.replace_gemms(per_expert_mm=False, grouped_mm=True, quack="")):
            grouped = fwd_bwd(args)
        for i, (a, b) in enumerate(zip(got, grouped)):
            assert torch.equal(a, b), f"tensor {i} differs from torch._grouped_mm's"


def test_per_expert_mm_is_left_out_while_capturing():
    """A CUDA graph being captured cannot read the row counts on the host: the GEMMs take the other knobs' path
    there (capture succeeds and replays what that path computes)."""
    hidden, ids, weights, w_up, w_down, _, _, spec = cuda_args(2048, 256, 512, 8, 2)
    grad = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
    cfg = kconfig.heuristic_config(4096, 8, 256, 512).replace_gemms(per_expert_mm=True)

    def step():
        out, *plan = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], spec.encode())
        grads = torch.ops.uniep.moe_experts_backward(grad, hidden, ids, weights, w_up, w_down, None, None, [],
                                                     *plan, spec.encode())
        return out, grads[0], grads[2], grads[3]

    with kconfig.use_config(cfg):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        counters.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        assert counters["uniep_kernels"]["per_expert_mm_gemms"] == 0
    graph.replay()
    with kconfig.use_config(cfg.replace_gemms(per_expert_mm=False)):
        fresh = step()
    for a, b in zip(captured, fresh):
        assert torch.equal(a, b)


def test_in_place_backward_is_bitwise_equal_to_out_of_place():
    args = list(cuda_args(900, 256, 384, 16, 4, GPT_OSS, "io", True))
    expected = fwd_bwd(args)
    args[7] = dataclasses.replace(args[7], reuse_saved=True)
    for a, b in zip(fwd_bwd(args), expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reuse", [True, False])
def test_reduce_overhead_captures_forward_and_backward(reuse):
    """mode="reduce-overhead": inductor's CUDA graphs take both graphs (no host sync in the op, and the
    in-place backward's mutation of its saved inputs is handled)."""
    from hf_families import build_experts, discover_experts_classes, routed_inputs

    cls = {c.__name__: c for _, c in discover_experts_classes()}["MixtralExperts"]
    experts = build_experts(cls, "grouped_mm", torch.bfloat16).cuda()
    x, ids, w = routed_inputs(experts, tokens=256, top_k=2, dtype=torch.bfloat16)
    x, ids, w = x.detach().cuda().requires_grad_(), ids.cuda(), w.detach().cuda().requires_grad_()
    if reuse:  # the default; torch.compile takes mode= or options=, not both
        compiled = torch.compile(experts, backend="uniep", mode="reduce-overhead")
    else:
        compiled = torch.compile(experts, backend="uniep", options={
            "reuse_saved_buffers": False, "inductor": {"triton.cudagraphs": True}})
    results = []
    for _ in range(4):
        out = compiled(x, ids, w)
        grads = torch.autograd.grad(out.float().sum(), [x, w] + list(experts.parameters()))
        results.append([out.clone()] + [g.clone() for g in grads])
    assert counters["uniep"]["moe_experts"] == 1
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    for a, b in zip(results[-1], results[0]):
        assert torch.equal(a, b)


def test_compiled_backward_peak_is_the_saved_buffers_and_the_weight_gradients():
    """Issue 3's memory goal, as a bound: a compiled layer's forward + backward peaks at the saved projections
    ([rows, 2I] and [rows, H]), the two weight gradients and the output, as autograd's op-by-op backward of
    the sort + torch._grouped_mm baseline does. The input gradient ([T, H], 4 MB here) is allocated after the
    saved h is freed (the combine is a second op); with both alive the peak would exceed the bound by its size."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    T, H, I, E, K = 2048, 1024, 512, 16, 4
    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    experts = MixtralExperts(cfg).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, device="cuda"), -1), K, -1)
    w = w.to(torch.bfloat16)
    grad = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(experts, backend="uniep")

    def step():
        for p in experts.parameters():
            p.grad = None
        out = compiled(x.detach().requires_grad_(), ids, w.detach().requires_grad_())
        out.backward(grad)

    step()
    step()
    for p in experts.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert counters["uniep"]["moe_experts"] == 1
    rows, size = T * K, 2  # bf16
    bound = size * (rows * 2 * I + rows * H + E * 2 * I * H + E * H * I + T * H)
    slack = 2 ** 20  # the plan, the routing-weight gradient and the allocator's rounding
    assert peak <= bound + slack, (peak, bound)
