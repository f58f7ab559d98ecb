import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run in Triton's interpreter (tests/test_megakernel.py). Triton reads
# this when a kernel is decorated, so it is set before any uniep kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# max relative error (max |a-b| / max |b|) allowed against eager, per dtype
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def max_rel_err(actual, expected) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual)), "non-finite entries differ"
    if not finite.any():
        return 0.0
    scale = expected[finite].abs().max().clamp_min(1e-12)
    return ((actual[finite] - expected[finite]).abs().max() / scale).item()


def assert_routing_plan_equals_reference(ids, num_experts: int) -> None:
    """triton_routing.routing_plan of ``ids`` (on any device), clamped and not, equals the reference's plan of the
    same ids on the CPU, tensor for tensor (row_order, slot_row, expert_offsets)."""
    from uniep_dynamo.kernels import reference, triton_routing

    for clamp in (False, True):
        plan = triton_routing.routing_plan(ids, num_experts, clamp=clamp)
        expected = reference.routing_plan((ids.clamp(0, num_experts - 1) if clamp else ids).cpu(), num_experts)
        for a, b in zip(plan, expected):
            assert torch.equal(a.cpu(), b), clamp


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    have_gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if have_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not have_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; run on the device machines"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs, found {gpus}"))
