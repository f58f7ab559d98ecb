"""GPU: the MegaKernel search on a small shape. Every config it keeps computes the same bits as the
heuristic one (it only moves scheduling knobs), the cache it writes is what the op then runs with, and
the search cost is bounded by the budget."""
import contextlib

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_tuned_config_is_bitwise_the_heuristic_and_is_used_from_the_cache(tmp_path, monkeypatch):
    import uniep_dynamo  # noqa: F401
    from uniep_dynamo import tuner
    from uniep_dynamo.kernels import config as kconfig
    from uniep_dynamo.kernels import megakernel

    monkeypatch.setenv("UNIEP_CACHE_DIR", str(tmp_path))
    tokens, hidden, inter, experts, top_k = 1024, 512, 384, 8, 2
    result = tuner.tune_shape(tokens, hidden, inter, experts, top_k, budget=2, iters=3, warmup=1)
    heuristic = kconfig.heuristic_config(tokens * top_k, experts, hidden, inter)
    assert result.config.numerics_key() == heuristic.numerics_key()
    assert result.measured + sum(result.rejected.values()) <= 2 * 7  # six GEMMs and the layer knobs
    assert result.tuned_ms <= result.heuristic_ms
    # the op with the tuned config, chosen through the cache, against the heuristic config: bit for bit
    tuner.store_entries(torch.cuda.get_device_name(), {result.key: {"config": tuner.config_to_dict(result.config)}})
    device = torch.device("cuda", torch.cuda.current_device())
    assert kconfig.current_config(tokens * top_k, experts, hidden, inter, False, dtype=torch.bfloat16,
                                  device=device) == result.config
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(tokens, hidden, generator=g).cuda().bfloat16(),
            torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).cuda(),
            torch.rand(tokens, top_k, generator=g).cuda().bfloat16(),
            (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05).cuda().bfloat16(),
            (torch.randn(experts, hidden, inter, generator=g) * 0.05).cuda().bfloat16()]
    from uniep_dynamo.kernels import gate_program
    from uniep_dynamo.spec import ExpertsSpec
    spec_obj = ExpertsSpec("oi", "oi", gate_program.encode("chunk", ["call", "mul", [
        ["call", "silu", [["gate"]], {}], ["up"]], {}]), torch.bfloat16)
    spec = spec_obj.encode()
    assert megakernel.use_megakernel(args[0], args[1], args[3], args[4], None, None, [], spec_obj)

    def run(config=None):
        leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in args]
        with kconfig.use_config(config) if config is not None else contextlib.nullcontext():
            out = torch.ops.uniep.moe_experts(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], None, None, [],
                                              spec)[0]
            out.backward(torch.ones_like(out))
        return [out] + [t.grad for t in leaves if t.is_floating_point()]

    for a, b in zip(run(), run(heuristic)):  # run(): the cached (tuned) config
        assert torch.equal(a, b)
