"""kernels/launch.py on a GPU: launches through the compiled kernel's launcher give the bits of Triton's own
launch path, and a kernel is looked up under Triton's specialization (an unaligned view gets its own kernel)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (launch.py's fast path "
                                 "calls the compiled kernel's launcher; the interpreter takes Triton's own path)")]


def test_fast_launches_match_triton_launches_bitwise():
    from test_gpu_megakernel import CASES, cuda_args, fwd_bwd
    from uniep_dynamo.kernels import launch

    args = cuda_args(*CASES[0])
    launch.FAST = False
    try:
        reference = fwd_bwd(args)
    finally:
        launch.FAST = True
    fwd_bwd(args)  # fills launch.py's cache
    before = launch.counts["fast"]
    again = fwd_bwd(args)
    assert launch.counts["fast"] > before, "no launch took the fast path"
    for a, b in zip(reference, again):
        assert torch.equal(a, b)


def test_unaligned_view_gets_its_own_kernel():
    from uniep_dynamo.kernels import launch
    from uniep_dynamo.kernels.triton_routing import gather_rows

    src = torch.randn(64, 24, device="cuda", dtype=torch.float16)
    order = torch.randperm(64, device="cuda")
    aligned = gather_rows(src, order, 1)
    gather_rows(src, order, 1)
    keys = len(launch._KERNELS)
    flat = torch.randn(64 * 24 + 1, device="cuda", dtype=torch.float16)
    shifted = flat[1:].view(64, 24)  # 2 bytes past a 16-byte boundary
    shifted.copy_(src)
    assert shifted.data_ptr() % 16 != 0
    assert torch.equal(gather_rows(shifted, order, 1), aligned)
    assert len(launch._KERNELS) > keys, "the unaligned source reused the aligned source's kernel"
    assert torch.equal(gather_rows(shifted, order, 1), src[order])
