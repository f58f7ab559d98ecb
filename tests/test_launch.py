"""kernels/launch.py: the launch cache keys every property Triton specializes on, and reuses a compiled kernel
only for the same key (CPU, with a stand-in for a Triton kernel; the GPU tests run the real one)."""
import torch

from uniep_dynamo.kernels import launch as launch_mod


class FakeKernel:
    """Records launches: through kernel[grid] (the binder) or through the compiled kernel it returned."""
    arg_names = ["x_ptr", "n", "scale", "flag", "BLOCK"]
    constexprs = [4]

    def __init__(self):
        self.compiled, self.direct = 0, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiled += 1
            kernel = self

            class Compiled:
                def __getitem__(self, grid):
                    return lambda *values: kernel.direct.append((grid, values))
            return Compiled()
        return run


def test_same_specialization_reuses_the_compiled_kernel_with_every_argument_in_order(monkeypatch):
    monkeypatch.setattr(launch_mod, "_CACHE", {})
    k = FakeKernel()
    x = torch.zeros(64)
    launch_mod._cached(k, (4,), 0, (x, 32, 0.5), {"flag": True, "BLOCK": 128, "num_warps": 4})
    launch_mod._cached(k, (8,), 0, (x, 48, 0.25), {"flag": False, "BLOCK": 128, "num_warps": 4})
    assert k.compiled == 1
    assert k.direct == [((8, 1, 1), (x, 48, 0.25, False, 128))]


def test_every_specialized_property_changes_the_key(monkeypatch):
    monkeypatch.setattr(launch_mod, "_CACHE", {})
    k = FakeKernel()
    x = torch.zeros(64)
    base = ((x, 32, 0.5), {"flag": True, "BLOCK": 128, "num_warps": 4})
    variants = [
        ((x[1:], 32, 0.5), base[1]),                      # data pointer no longer 16-byte aligned
        ((x.half(), 32, 0.5), base[1]),                   # dtype
        ((x, 33, 0.5), base[1]),                          # not a multiple of 16
        ((x, 1, 0.5), base[1]),                           # equal to 1
        ((x, 2**31 + 16, 0.5), base[1]),                  # int64
        ((x, 32, 0.5), {**base[1], "BLOCK": 256}),        # a constexpr value
        ((x, 32, 0.5), {**base[1], "num_warps": 8}),      # a launch option
    ]
    launch_mod._cached(k, (1,), 0, *base)
    for args, kwargs in variants:
        launch_mod._cached(k, (1,), 0, args, kwargs)
    launch_mod._cached(k, (1,), 1, *base)  # another device
    assert k.compiled == 2 + len(variants) and not k.direct


def test_cpu_tensors_take_tritons_own_path():
    k = FakeKernel()
    launch_mod.launch(k, (1,), torch.zeros(4), 16, 1.0, flag=True, BLOCK=16)
    launch_mod.launch(k, (1,), torch.zeros(4), 16, 1.0, flag=True, BLOCK=16)
    assert k.compiled == 2 and not k.direct
