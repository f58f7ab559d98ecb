"""kernels/batch_copy.py on a machine without CUDA: it says so, and it refuses malformed batches before any driver
call (the copies themselves run in tests/test_gpu_ep.py's batched knob rows)."""
import pytest
import torch

from uniep_dynamo.kernels import batch_copy


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a CUDA driver")
def test_unavailable_without_a_driver():
    assert batch_copy.available() is False


def test_malformed_batches_are_refused():
    with pytest.raises(ValueError, match="one length"):
        batch_copy.copy_batch([1, 2], [3], [4, 5], stream=1)
    with pytest.raises(ValueError, match="legacy default stream"):
        batch_copy.copy_batch([1], [2], [3], stream=0)
    batch_copy.copy_batch([], [], [], stream=1)  # nothing to copy: no driver call
