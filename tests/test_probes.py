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
