"""The EP part of the search space and tuner (uniep_dynamo/tuner.py): candidate pruning, the tuner over 2 gloo
ranks (Triton's interpreter, the host clock for timing; times on CPU mean nothing, the mechanics are the
test), and the cache round trip of a tuned OverlapConfig."""
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from test_ep import gloo_group, run_workers
from test_reference import make
from uniep_dynamo import tuner
from uniep_dynamo.ep import OverlapConfig

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for symmetric memory")


def _schedules(cands, local_experts, world=2):
    return [tuner._ep_schedule(c, local_experts, world) for c in cands]


def test_ep_candidates_default_first_distinct_and_pruned():
    cands = tuner.ep_candidates(local_experts=64, world=2)
    assert cands[0] == OverlapConfig()
    assert len(set(_schedules(cands, 64))) == len(cands)
    kernels = [c for c in cands if c.copy_kernel and c.copy_engine is False]
    assert {c.copy_programs for c in kernels} == set(tuner.EP_SPACE["copy_programs"])
    assert {c.copy_block for c in kernels} == set(tuner.EP_SPACE["copy_block"])
    assert {c.push_in_gemm_from for c in kernels} == set(tuner.EP_SPACE["push_in_gemm_from"])
    assert all(c.push_in_gemm_from == 0 for c in cands if c.copy_engine or not c.push_in_gemm)
    assert all((c.copy_programs, c.copy_block) == (OverlapConfig().copy_programs, OverlapConfig().copy_block)
               for c in cands if not c.copy_kernel)
    # one local expert: every chunk count is one chunk, so chunks no longer multiply the candidates
    one = tuner.ep_candidates(local_experts=1, world=2)
    assert len({c.chunk_experts(1, 2) for c in one}) == 1 and len(one) < len(cands)
    # past the transfer kernel's rank limit no candidate asks for it (the default's copy_kernel=True then runs
    # torch._foreach_copy_, kernels/triton_transfer.MAX_PEERS)
    assert not any(c.copy_kernel and c.copy_engine is False for c in tuner.ep_candidates(local_experts=4, world=16))


def _tune_worker(rank, world, port, out_dir):
    with gloo_group(rank, world, port, UNIEP_KERNELS="triton"):
        import uniep_dynamo  # noqa: F401

        hidden, ids, weights, w_up, w_down, _, _, spec = make(12, 16, 12, 4, 2)
        mine, experts = slice(rank * 6, rank * 6 + 6), slice(rank * 2, rank * 2 + 2)
        # a candidate that computes something else (timing="comm" skips the GEMMs) must be rejected, and the
        # one that does not must be measured
        tuner.ep_candidates = lambda local, w: [OverlapConfig(), OverlapConfig(timing="comm"),
                                                OverlapConfig(chunks=1, copy_engine=False, copy_kernel=True)]
        result = tuner.tune_ep(hidden[mine], ids[mine], weights[mine], w_up[experts], w_down[experts], spec.encode(),
                               iters=1, warmup=0)
        torch.save({"config": dataclasses.asdict(result.config), "measured": result.measured,
                    "rejected": result.rejected, "key": result.key, "times": (result.default_ms, result.tuned_ms)},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_tune_ep_rejects_changed_numerics_and_ranks_agree(tmp_path):
    ranks = run_workers(_tune_worker, 2, (), tmp_path)
    for r in ranks:
        assert r["measured"] == 1 and r["rejected"] == {"changed the numerics": 1}
        assert r["key"].endswith("/ep2") and "/E4/" in r["key"]
    assert ranks[0]["config"] == ranks[1]["config"]
    assert OverlapConfig(**ranks[0]["config"]) in (OverlapConfig(),
                                                   OverlapConfig(chunks=1, copy_engine=False, copy_kernel=True))
    assert ranks[0]["times"] == ranks[1]["times"]  # the slowest rank's time, on every rank


def test_ep_cache_round_trip_and_a_broken_entry(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("UNIEP_CACHE_DIR", str(tmp_path))
    cfg = OverlapConfig(chunks=2, copy_engine=False, copy_kernel=True, copy_programs=64)
    key = tuner.shape_key(torch.bfloat16, 131072, 128, 2048, 768, ep_size=4)
    tuner.store_entries("Fake GPU", {key: tuner.ep_config_to_dict(cfg), "bad": {"ep_overlap": {"chunks": 0}}})
    assert tuner.cached_ep_config("Fake GPU", key) == cfg
    assert tuner.cached_ep_config("Fake GPU", "absent") is None
    assert tuner.cached_ep_config("Fake GPU", "bad") is None
    assert "ignoring the tuning cache entry bad" in caplog.text
    monkeypatch.setenv("UNIEP_TUNE", "0")
    assert tuner.cached_ep_config("Fake GPU", key) is None


def test_the_direct_layer_and_the_compiled_exchange_read_one_cache_entry(tmp_path, monkeypatch):
    """ep_experts_overlapped (hidden [T, H], ids [T, K]) and uniep.ep_exchange (the T * K rows it sends) look up the
    same entry: the tuned knobs of the shape, else the defaults; the CPU path always runs the defaults."""
    import types

    from uniep_dynamo.ep import config as ep_config
    from uniep_dynamo import tuning_cache

    monkeypatch.setenv("UNIEP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning_cache, "gpu_name", lambda device: "Fake GPU")
    monkeypatch.setattr(ep_config.dist, "get_world_size", lambda group=None: 4)
    hidden, ids, _, w_up, w_down, _, _, spec = make(12, 16, 12, 4, 2)  # 4 local experts of 16 in all
    tuned = OverlapConfig(chunks=2, copy_engine=False, copy_kernel=True, copy_programs=64)
    key = tuner.shape_key(hidden.dtype, 12 * 2 * 4, 16, 16, 12, ep_size=4)
    tuner.store_entries("Fake GPU", {key: tuner.ep_config_to_dict(tuned)})

    def on_gpu(t):  # the lookup reads only the device, dtype and width
        return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=t.dtype, shape=t.shape)
    assert ep_config.default_knobs(on_gpu(hidden), ids, w_up, w_down, spec, None) == tuned
    rows = torch.empty(ids.numel(), 16, dtype=hidden.dtype)
    assert ep_config.cached_knobs(on_gpu(rows), rows.shape[0], w_up, w_down, spec, None) == tuned
    assert ep_config.knobs_from_json("") is None  # the rewrite without ep_knobs: exchange_forward looks it up
    # another row bucket, or the CPU path: the defaults
    assert ep_config.cached_knobs(on_gpu(rows), 4 * rows.shape[0], w_up, w_down, spec, None) == OverlapConfig()
    assert ep_config.cached_knobs(rows, rows.shape[0], w_up, w_down, spec, None) == OverlapConfig()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_uniep_tune_ep_command_smoke_run(tmp_path, capsys):
    import json

    from uniep_dynamo.cli import uniep_main

    out = tmp_path / "ep.json"
    kernels = os.environ.get("UNIEP_KERNELS")
    assert uniep_main(["tune", "--ep", "2", "--device", "cpu", "--shape", "16,12,4,2", "--tokens", "6",
                       "--budget", "2", "--iters", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["key"].endswith("/ep2") and row["measured"] + sum(row["rejected"].values()) == 2
    assert "EP over 2 ranks" in capsys.readouterr().out
    assert os.environ.get("UNIEP_KERNELS") == kernels  # the smoke run's environment stays in its workers


def test_confirm_keeps_the_winner_only_if_it_still_wins():
    times = {"base": iter([5.0, 4.0, 6.0]), "fast": iter([3.0, 3.5, 9.0]), "slow": iter([4.5, 4.2, 4.1])}
    assert tuner._confirm("base", "fast", lambda cfg: next(times[cfg])) == (4.0, "fast", 3.0)
    times["base"] = iter([5.0, 4.0, 6.0])
    assert tuner._confirm("base", "slow", lambda cfg: next(times[cfg])) == (4.0, "base", 4.0)
