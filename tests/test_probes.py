"""The benchmark probes that measure issue 3's limits compute what they claim to (CPU: Triton's interpreter, fp32).

goal_floor_probe.py takes, per GEMM of a layer, the fastest of three kernels; that is only a floor if the three
compute the same GEMM. They use megakernel's private GEMM entry points, so a change there must not leave the probe
timing something else.
"""
import os
import sys

import pytest
import torch

from uniep_dynamo.kernels import config as kconfig

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
if not kconfig.interpreting():
    pytest.skip("runs the Triton GEMMs on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, which conftest sets "
                "on machines without a GPU); on a GPU the probe itself runs them", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def probe_path(monkeypatch):
    for sub in ("benchmarks", os.path.join("benchmarks", "probes")):
        monkeypatch.syspath_prepend(os.path.join(ROOT, sub))
    yield
    for name in ("cublas_loop_probe", "breakdown_probe", "bench_moe_layer"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("E,K,tokens,idle", [(4, 2, 37, False), (8, 2, 3, True)])
def test_six_gemms_providers_compute_the_same_gemms(probe_path, E, K, tokens, idle):
    from cublas_loop_probe import GEMMS, six_gemms

    H, I = 32, 16
    gemms, counts = six_gemms(H, I, E, K, tokens, dev="cpu", dtype=torch.float32, triton=True)
    assert tuple(gemms) == GEMMS and sum(counts) == tokens * K
    assert (0 in counts) == idle  # the second case has experts without rows (zero weight gradients)
    for name, (flops, calls, shape) in gemms.items():
        assert set(calls) == {"grouped_mm", "cublas_loop", "triton"}
        loop, tri = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        calls["cublas_loop"](loop)
        calls["triton"](tri)
        grouped = calls["grouped_mm"](None)
        assert grouped.shape == loop.shape == tri.shape, name
        assert torch.allclose(tri, loop, rtol=1e-5, atol=1e-6), name  # no NaN left: every element written
        assert torch.allclose(grouped, loop, rtol=1e-5, atol=1e-6), name
        assert flops > 0 and loop.abs().sum() > 0, name


def test_breakdown_probe_labels_keyword_calls_as_positional_ones(probe_path):
    """breakdown_probe.py labels each timed piece by the arguments of uniep's kernel entry point, bound by its
    signature: an argument passed by keyword gets the label it gets passed by position (read by position, it was
    missed, and the provider's cell became "ERR")."""
    import inspect
    from types import SimpleNamespace

    from breakdown_probe import call_label, piece_labels
    from uniep_dynamo.kernels.config import GEMMS

    entry = {name: (getattr(module, name), label_of) for module, name, label_of in piece_labels()}
    layer = SimpleNamespace(config=SimpleNamespace(**{g: object() for g in GEMMS}))
    rows = weights = torch.zeros(1)
    cases = [  # (entry point, its leading arguments, label): the labels that read an argument
        ("rows_gemm", (layer, layer.config.down), "down"),
        ("weight_grad", (layer, layer.config.wgrad_up), "wgrad_up"),
        ("gather_rows", (rows, None, 2, weights), "gather_rows_scaled"),
        ("gather_rows", (rows, None, 2), "gather_rows"),  # weights left to the default
        ("combine", (rows, None, weights, None, 1, 2, torch.float32), "combine"),
        ("combine", (rows, None, None, None, 1, 2, torch.float32), "combine_grad"),
    ]
    for name, args, label in cases:
        fn, label_of = entry[name]
        signature = inspect.signature(fn)
        params = list(signature.parameters.values())
        required = {p.name: None for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
        by_position = call_label(signature, label_of, args, required)
        by_name = call_label(signature, label_of, (), {**{p.name: a for p, a in zip(params, args)}, **required})
        assert by_position == by_name == label, (name, by_position, by_name)


def test_sonicmoe_spaces_and_their_configs_around_each_provider(probe_path, monkeypatch):
    """bench_moe_layer's SonicMoE providers: "small" keeps only SONICMOE_SMALL_SPACE's configs (no swap_ab) of each
    QuACK GEMM's own list, "default" one config (QuACK's default: no tuning), "full" the whole list; each provider's
    ``around`` installs its own candidate configs and tuning results for its forward and backward and puts the
    previous ones back (two SonicMoE providers in one run neither share nor clobber their tuning). QuACK and
    SonicMoE are stood in for by fakes: neither runs on CPU."""
    import types
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Cfg:
        tile_m: int
        tile_n: int
        pingpong: bool
        cluster_m: int
        cluster_n: int
        swap_ab: bool = False

    class AutotuneConfig:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class Tuned:
        def __init__(self, configs):
            self.configs, self.cache = configs, {}

    every = [AutotuneConfig(config=Cfg(m, n, p, cm, cn, s)) for m in (128, 192, 256) for n in (128, 160, 192, 208, 256)
             for p in (False, True) for cm, cn in ((1, 2), (2, 1)) for s in (False, True)]
    gemm_interface = types.SimpleNamespace()
    from_quack = {}
    seen = []  # (name, its configs, its cache) as the fake SonicMoE's GEMM saw them

    def moe_general_routing_inputs(x, *args, **kwargs):
        for name in ("gemm_tuned", "gemm_gated_tuned"):
            t = getattr(gemm_interface, name)
            seen.append((name, t.configs, t.cache))
            t.cache["key"] = len(seen)  # a tuning result of this provider
        return x * 2, None

    for name in ("gemm_tuned", "gemm_act_tuned", "gemm_dact_tuned", "gemm_gated_tuned", "gemm_dgated_tuned"):
        setattr(gemm_interface, name, Tuned(list(every)))
        from_quack[name] = getattr(gemm_interface, name).configs
    quack = types.ModuleType("quack")
    quack.gemm_interface = gemm_interface
    autotuner = types.ModuleType("quack.autotuner")
    autotuner.AutotuneConfig = AutotuneConfig
    sonicmoe = types.ModuleType("sonicmoe")
    sonicmoe.moe_general_routing_inputs = moe_general_routing_inputs
    enums = types.ModuleType("sonicmoe.enums")
    enums.ActivationType = types.SimpleNamespace(SWIGLU="swiglu")
    for mod, name in ((quack, "quack"), (gemm_interface, "quack.gemm_interface"), (autotuner, "quack.autotuner"),
                      (sonicmoe, "sonicmoe"), (enums, "sonicmoe.enums")):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=0))
    from bench_moe_layer import SONICMOE_SMALL_SPACE, sonicmoe_experts, sonicmoe_space

    small = sonicmoe_space("small")["gemm_tuned"]
    keys = {(c.kwargs["config"].tile_m, c.kwargs["config"].tile_n, c.kwargs["config"].pingpong,
             c.kwargs["config"].cluster_m, c.kwargs["config"].cluster_n) for c in small}
    assert keys and keys <= set(SONICMOE_SMALL_SPACE) and not any(c.kwargs["config"].swap_ab for c in small)
    assert keys == {k for k in SONICMOE_SMALL_SPACE if k[0] in (128, 192, 256) and k[1] in (128, 160, 192, 208, 256)}
    default = sonicmoe_space("default")["gemm_dgated_tuned"]
    assert len(default) == 1 and default[0].kwargs["config"] is None
    assert sonicmoe_space("full")["gemm_gated_tuned"] == every
    with pytest.raises(ValueError, match="space"):
        sonicmoe_space("tuned")

    experts = types.SimpleNamespace(gate_up_proj=torch.zeros(4, 6, 3), down_proj=torch.zeros(4, 3, 3))
    fast, tuned = sonicmoe_experts(experts, "default"), sonicmoe_experts(experts, "small")
    x, ids, w = torch.ones(2, 3), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
    for fn in (fast, tuned, fast):
        with fn.around():
            assert torch.equal(fn(x, ids, w), x * 2)
    (_, c0, k0), (_, c1, _), (_, c2, k2), (_, c3, _), (_, c4, k4), _ = seen
    assert len(c0) == len(c1) == 1 and c2 == small and len(c3) < len(every) and c4 is c0
    assert k0 is k4 and k0 is not k2 and k2 == {"key": 3}  # each provider's tuning results are its own
    assert tuned.tuned() == {"gemm_tuned": {"key": 3}, "gemm_gated_tuned": {"key": 4}}
    for name, configs in from_quack.items():  # QuACK's own lists and caches are back after each provider
        assert getattr(gemm_interface, name).configs is configs and getattr(gemm_interface, name).cache == {}
