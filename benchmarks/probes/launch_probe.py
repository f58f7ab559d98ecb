"""Probe: host time of one Triton launch of the MegaKernel's row GEMM and of the EP transfer kernel: through
JITFunction.__getitem__ (the binder), through uniep's launch cache (kernels/launch.py) and through the cached
CompiledKernel alone. One GPU.

    python benchmarks/probes/launch_probe.py
"""
import time

import torch


def host_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def main():
    from uniep_dynamo.kernels import gate_program, megakernel
    from uniep_dynamo.kernels.triton_gemm import STORE
    from uniep_dynamo.kernels.triton_transfer import _copy_segments, copy_segments, segment_table
    from uniep_dynamo.spec import decode_spec, ExpertsSpec

    dev = torch.device("cuda")
    rows, hidden, inter, experts = 4096, 2048, 768, 16
    x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    w_up = torch.randn(experts, hidden, 2 * inter, device=dev, dtype=torch.bfloat16)
    w_down = torch.randn(experts, inter, hidden, device=dev, dtype=torch.bfloat16)
    act = torch.randn(rows, inter, device=dev, dtype=torch.bfloat16)
    out = torch.empty(rows, hidden, device=dev, dtype=torch.bfloat16)
    spec = decode_spec(ExpertsSpec("io", "io", gate_program.encode("chunk", gate_program.SILU_GLU_EXPR),
                                   torch.bfloat16).encode())
    layer = megakernel._Layer(x, (rows, 1), w_up, w_down, spec)
    offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int64) * (rows // experts)

    def gemm():
        megakernel._rows_gemm(layer, layer.config.down, a=act, gather=False, row_order=offs, b=layer.down_eff,
                              n=hidden, k=inter, epilogue=STORE, c=out, offsets=offs)
    segs = [(0, i * 256, i * 256, 256) for i in range(16)]
    table_rows, blocks = segment_table(segs, hidden, 8192)
    table = torch.tensor(table_rows, dtype=torch.int64, device=dev)
    dst = torch.empty_like(x)

    def copy():
        copy_segments(table, blocks, dst, [x], False, 32, 8192, 8)
    from uniep_dynamo.kernels import launch as launch_mod
    launch_mod._ENABLED = False
    print(f"_rows_gemm via the binder: {host_us(gemm):.1f} us per launch", flush=True)
    print(f"copy_segments via the binder: {host_us(copy):.1f} us per launch", flush=True)
    launch_mod._ENABLED = True
    print(f"_rows_gemm via uniep's launch cache: {host_us(gemm):.1f} us per launch", flush=True)
    print(f"copy_segments via uniep's launch cache: {host_us(copy):.1f} us per launch", flush=True)
    compiled = _copy_segments[(32,)](table, blocks, dst.view(torch.int16), *([x.view(torch.int16)] * 8), PUSH=False,
                                     VEC=8, BLOCK=8192, num_warps=8)
    args = (table, blocks, dst.view(torch.int16), *([x.view(torch.int16)] * 8), False, 8, 8192)
    runner = compiled[(32, 1, 1)]
    print(f"copy_segments via the compiled kernel: {host_us(lambda: runner(*args)):.1f} us per launch", flush=True)
    print(f"torch empty: {host_us(lambda: torch.empty(rows, hidden, device=dev)):.1f} us; slice: "
          f"{host_us(lambda: x[5:100]):.1f} us; event record: {host_us(lambda: torch.cuda.Event().record()):.1f} us",
          flush=True)


if __name__ == "__main__":
    main()
