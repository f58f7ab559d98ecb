"""kernels/launch.py's logic on CPU with a stand-in kernel (the GPU path: tests/test_gpu_launch.py): a miss goes
through kernel[grid] and keeps the compiled kernel, a hit calls its launcher with the bound arguments, launch hooks
and a launcher that refuses the arguments send it back to Triton's own path."""
import types

import pytest
import torch

from uniep_dynamo.kernels import launch


class _Compiled:
    def __init__(self, fail=False):
        self.function, self.packed_metadata, self.calls, self.fail = "fn", "meta", [], fail

    def run(self, *args):
        if self.fail:
            raise TypeError("launcher takes other arguments")
        self.calls.append(args)


class _Kernel:
    """What launch.py reads of a JITFunction: device_caches' binder, pre_run_hooks and kernel[grid](...)."""

    def __init__(self, compiled):
        self.compiled, self.triton_calls, self.pre_run_hooks = compiled, [], []
        binder = lambda x, n, BLOCK, num_warps: ({"x": x, "n": n, "BLOCK": BLOCK},  # noqa: E731
                                                 [("*fp32", "D"), ("i32", "D" if n % 16 == 0 else None),
                                                  ("constexpr", BLOCK)], {"num_warps": num_warps})
        self.device_caches = {0: ({}, {}, None, None, binder)}

    def __getitem__(self, grid):
        def runner(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            return self.compiled
        return runner


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    hooks = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]), launch_exit_hook=None)
    monkeypatch.setattr(launch, "_RUNTIME", [hooks, lambda device: 77])
    monkeypatch.setattr(launch, "_KERNELS", {})
    monkeypatch.setattr(launch, "FAST", True)
    return hooks


def test_miss_then_hit_under_tritons_specialization(fake_cuda):
    kernel = _Kernel(_Compiled())
    launch.launch(kernel, (4,), "x", 32, BLOCK=64, num_warps=4)
    assert len(kernel.triton_calls) == 1 and not kernel.compiled.calls
    launch.launch(kernel, (5, 2), "y", 48, BLOCK=64, num_warps=4)  # same specialization: the launcher
    assert len(kernel.triton_calls) == 1
    assert kernel.compiled.calls == [(5, 2, 1, 77, "fn", "meta", None, None, None, "y", 48, 64)]
    launch.launch(kernel, (4,), "x", 33, BLOCK=64, num_warps=4)  # n no longer a multiple of 16: a new key
    launch.launch(kernel, (4,), "x", 32, BLOCK=128, num_warps=4)  # another constexpr
    launch.launch(kernel, (4,), "x", 32, BLOCK=64, num_warps=8)  # another launch option
    assert len(kernel.triton_calls) == 4 and len(kernel.compiled.calls) == 1


def test_hooks_and_refusing_launchers_take_tritons_path(fake_cuda):
    kernel = _Kernel(_Compiled())
    fake_cuda.launch_enter_hook.calls.append(print)  # a profiler's hook: Triton's path calls it
    for _ in range(2):
        launch.launch(kernel, (4,), "x", 32, BLOCK=64, num_warps=4)
    assert len(kernel.triton_calls) == 2 and not kernel.compiled.calls
    fake_cuda.launch_enter_hook.calls.clear()
    refusing = _Kernel(_Compiled(fail=True))
    for _ in range(3):
        launch.launch(refusing, (4,), "x", 32, BLOCK=64, num_warps=4)
    assert len(refusing.triton_calls) == 3 and launch.FAST is False  # every launch happened once, by Triton


def test_hooked():
    assert not launch._hooked(None) and not launch._hooked(types.SimpleNamespace(calls=[]))
    assert launch._hooked(types.SimpleNamespace(calls=[print])) and launch._hooked(print)
