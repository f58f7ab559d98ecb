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
    for name in ("cublas_loop_probe", "bench_moe_layer"):
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
