"""The MegaKernel search (uniep_dynamo/tuner.py) on CPU: the space and its pruning, the tuning cache (round
trip, versions, a broken file, concurrent writers), how the op picks a cached config, and `uniep tune`'s
argument handling. The search itself times kernels on a GPU (tests/test_gpu_tuner.py)."""
import dataclasses
import json
import logging
import os

import pytest
import torch
import torch.multiprocessing as mp

from uniep_dynamo import cli, tuner, tuning_cache
from uniep_dynamo.kernels import config as kconfig

H100 = dict(smem_limit=227 * 1024, sm_count=132)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIEP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("UNIEP_TUNE", raising=False)
    tuning_cache._MEMO.clear()
    return tmp_path / "cache"


def _heuristic(rows=16384):
    return kconfig.heuristic_config(rows, 8, 4096, 14336)


def test_every_candidate_is_valid_and_keeps_the_numerics_knobs():
    base = _heuristic().up
    cands = tuner.gemm_candidates(base, n_dim=14336, n_factor=2, **H100)
    assert cands[0] == base and len(set(cands)) == len(cands)
    full = 1
    for values in tuner.SPACE.values():
        full *= len(values)
    assert 10 < len(cands) < full  # pruning removed some, kept many
    for c in cands[1:]:
        c.validate()
        assert c.block_k == base.block_k
        assert tuner.prune_reason(c, n_dim=14336, n_factor=2, smem_limit=H100["smem_limit"]) is None
        assert c.num_programs in (0, 132)


@pytest.mark.parametrize("cfg,n_dim,n_factor,reason", [
    # 5 stages of 128x(2*256)x64 bf16 tiles: 409 KB of shared memory
    (kconfig.GemmConfig(block_m=128, block_n=256, num_stages=5), 14336, 2, "shared memory"),
    # a 128x256 fp32 accumulator over 4 warps: 256 registers per thread
    (kconfig.GemmConfig(block_m=128, block_n=256, num_warps=4, num_stages=2), 4096, 1, "accumulator registers"),
    # 256 columns of tile for a 96-column problem
    (kconfig.GemmConfig(block_m=64, block_n=256, num_warps=8, num_stages=2), 96, 1, "wider than the problem"),
    # block_m 32 would leave the wgmma path (config.py's numerics contract)
    (kconfig.GemmConfig(block_m=32), 4096, 1, "tensor-core path"),
    # Triton's warp specialization pass fails on 4 warps (every compile failure of the tuner on an H200)
    (kconfig.GemmConfig(block_m=128, block_n=64, num_warps=4, num_programs=132, warp_specialize=True), 4096, 1,
     "warp specialization"),
])
def test_pruning_says_why(cfg, n_dim, n_factor, reason):
    assert reason in tuner.prune_reason(cfg, n_dim=n_dim, n_factor=n_factor, smem_limit=227 * 1024)


def test_spread_is_deterministic_and_bounded():
    items = list(range(50))
    assert tuner._spread(items, 5) == [0, 12, 24, 37, 49] == tuner._spread(items, 5)
    assert tuner._spread(items[:3], 5) == [0, 1, 2]


def _tuned():
    return dataclasses.replace(_heuristic(), down=dataclasses.replace(_heuristic().down, block_n=128, num_stages=4),
                               fuse_gather=True)


def test_cache_round_trip_and_lookup_by_the_op(monkeypatch):
    key = tuner.shape_key(torch.bfloat16, 16384, 8, 4096, 14336)
    assert key == "bfloat16/E8/H4096/I14336/rows<=16384/ep1"
    assert tuner.shape_key(torch.bfloat16, 9000, 8, 4096, 14336) == key  # rows bucketed to a power of two
    path = tuner.store_entries("NVIDIA H200", {key: {"config": tuner.config_to_dict(_tuned())}})
    assert tuner.cached_config("NVIDIA H200", key) == _tuned()
    assert tuner.cached_config("NVIDIA H100 80GB HBM3", key) is None  # another GPU model, another file
    assert json.load(open(path))["entries"][key]["config"]["fuse_gather"] is True
    # the op's lookup: CUDA, this GPU, this dtype and shape (no GPU needed to ask)
    monkeypatch.setattr(tuning_cache, "gpu_name", lambda device: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    assert kconfig.current_config(9000, 8, 4096, 14336, False, dtype=torch.bfloat16, device=cuda) == _tuned()
    assert kconfig.current_config(9000, 8, 4096, 14336, False, dtype=torch.float16, device=cuda) == _heuristic(9000)
    assert kconfig.current_config(9000, 8, 4096, 14336, True, dtype=torch.bfloat16, device=cuda) != _tuned()
    with kconfig.use_config(_heuristic()):  # an explicit config wins over the cache
        assert kconfig.current_config(9000, 8, 4096, 14336, False, dtype=torch.bfloat16, device=cuda) == _heuristic()
    monkeypatch.setenv("UNIEP_TUNE", "0")
    assert kconfig.current_config(9000, 8, 4096, 14336, False, dtype=torch.bfloat16, device=cuda) == _heuristic(9000)


def test_a_cached_config_that_changes_numerics_is_not_used(monkeypatch, caplog):
    key = tuner.shape_key(torch.bfloat16, 16384, 8, 4096, 14336)
    bad = _heuristic().replace_gemms(block_k=128)
    tuner.store_entries("NVIDIA H200", {key: {"config": tuner.config_to_dict(bad)}})
    monkeypatch.setattr(tuning_cache, "gpu_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(kconfig, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="uniep"):
        got = kconfig.current_config(16384, 8, 4096, 14336, False, dtype=torch.bfloat16,
                                     device=torch.device("cuda", 0))
    assert got == _heuristic() and "changes numerics knobs" in caplog.text


def test_a_cached_config_is_checked_against_the_variables_numerics(monkeypatch, caplog):
    """UNIEP_GATED_EPILOGUE=1 applies to the tuned config and the heuristics' alike before their numerics are
    compared: a tuned config tuned with the knob off whose up projection is not QuACK's (which under the knob decides
    the saved h's layout and the activation's bits) is refused; one that only moves QuACK tiles is served, with the
    knob."""
    shape = (65536, 128, 2048, 768)
    key = tuner.shape_key(torch.bfloat16, *shape)
    heuristic = kconfig.heuristic_config(*shape)
    assert heuristic.up.quack and not heuristic.gated_epilogue
    monkeypatch.setattr(tuning_cache, "gpu_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(kconfig, "_WARNED", set())
    monkeypatch.setenv("UNIEP_GATED_EPILOGUE", "1")
    cuda = torch.device("cuda", 0)
    no_gated_up = dataclasses.replace(heuristic, up=dataclasses.replace(heuristic.up, quack=""))
    assert no_gated_up.numerics_key() == heuristic.numerics_key()  # the same numerics with the knob off
    tuner.store_entries("NVIDIA H200", {key: {"config": tuner.config_to_dict(no_gated_up)}})
    with caplog.at_level(logging.WARNING, logger="uniep"):
        got = kconfig.current_config(*shape, False, dtype=torch.bfloat16, device=cuda)
    assert got == kconfig.gated_config(heuristic) and "changes numerics knobs" in caplog.text
    other_tiles = dataclasses.replace(heuristic, down=dataclasses.replace(heuristic.down, quack="128x192/pingpong/2x1"))
    tuner.store_entries("NVIDIA H200", {key: {"config": tuner.config_to_dict(other_tiles)}})
    assert kconfig.current_config(*shape, False, dtype=torch.bfloat16, device=cuda) == \
        kconfig.gated_config(other_tiles)


def test_versions_key_the_cache(monkeypatch):
    key = tuner.shape_key(torch.bfloat16, 16384, 8, 4096, 14336)
    tuner.store_entries("NVIDIA H200", {key: {"config": tuner.config_to_dict(_tuned())}})
    monkeypatch.setattr(tuning_cache, "versions", lambda: ("0.1.0", "9.9.9", "9.9.9"))
    assert "torch9.9.9" in tuner.cache_path("NVIDIA H200")
    assert tuner.cached_config("NVIDIA H200", key) is None


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 99, "entries": {}}), json.dumps([1, 2])])
def test_a_broken_cache_file_is_ignored_with_a_warning(content, caplog):
    path = tuner.cache_path("NVIDIA H200")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write(content)
    with caplog.at_level(logging.WARNING, logger="uniep"):
        assert tuner.cached_config("NVIDIA H200", "bfloat16/E8/H1/I1/rows<=1/ep1") is None
    assert "ignoring the tuning cache" in caplog.text
    # the next write replaces it with a valid file
    tuner.store_entries("NVIDIA H200", {"k": {"config": tuner.config_to_dict(_tuned())}})
    assert tuner.cached_config("NVIDIA H200", "k") == _tuned()


def _writer(rank, cache, config_dict):
    os.environ["UNIEP_CACHE_DIR"] = cache
    for i in range(15):
        tuner.store_entries("NVIDIA H200", {f"rank{rank}/entry{i}": {"config": config_dict}})


def test_concurrent_writers_lose_nothing(cache_dir):
    mp.spawn(_writer, args=(str(cache_dir), tuner.config_to_dict(_tuned())), nprocs=4)
    data = json.load(open(tuner.cache_path("NVIDIA H200")))
    assert sorted(data["entries"]) == sorted(f"rank{r}/entry{i}" for r in range(4) for i in range(15))
    assert not [n for n in os.listdir(os.path.dirname(tuner.cache_path("x"))) if n.endswith(".tmp")]


def test_tune_command_arguments(capsys):
    from transformers import MixtralConfig, Qwen3MoeConfig
    assert cli.shapes_from_hf_config(Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                                    num_experts_per_tok=8)) == (2048, 768, 128, 8)
    assert cli.shapes_from_hf_config(MixtralConfig()) == (4096, 14336, 8, 2)
    with pytest.raises(SystemExit):
        cli.uniep_main(["tune", "--shape", "1,2,3"])
    assert "H,I,E,K" in capsys.readouterr().err
    assert cli.uniep_main(["frobnicate"]) == 2
    if not torch.cuda.is_available():
        assert cli.uniep_main(["tune", "--shape", "64,32,4,2"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_candidates_offer_quack_configs_only_where_quack_runs():
    """Where QuACK runs, a GEMM's candidates are its base, the other of torch._grouped_mm / Triton without QuACK, the
    base without QuACK and with each of QUACK_SPACE's configs, then Triton tiles (no QuACK); elsewhere none with it."""
    base = kconfig.heuristic_config(65536, 128, 2048, 768).down
    assert base.quack
    cands = tuner.gemm_candidates(base, n_dim=2048, **H100)
    assert cands[0] == base and cands[1] == dataclasses.replace(base, grouped_mm=not base.grouped_mm, quack="")
    quack = [c.quack for c in cands if c.quack]
    assert set(quack) == set(tuner.QUACK_SPACE) and len(quack) == len(tuner.QUACK_SPACE)
    assert dataclasses.replace(base, quack="") in cands
    assert all(not c.quack for c in cands if not c.grouped_mm and c != base)
    without = tuner.gemm_candidates(base, n_dim=2048, quack=False, **H100)
    assert [c for c in without if c.quack] == [base]


def test_another_process_write_is_read_once_the_stat_interval_has_passed(monkeypatch):
    """The ops read the cache file's stamp at most every STAT_INTERVAL_S: a write by another process (here, the file
    replaced behind the module's back) is read once that much time has passed, not before; this process's own
    store_entries is read at once."""
    clock = [100.0]
    monkeypatch.setattr(tuning_cache.time, "monotonic", lambda: clock[0])
    entry = {"config": tuner.config_to_dict(_tuned())}
    tuner.store_entries("NVIDIA H200", {"a": entry})
    assert tuner.cached_config("NVIDIA H200", "a") == _tuned()
    path = tuner.cache_path("NVIDIA H200")
    data = json.load(open(path))
    data["entries"]["b"] = entry
    with open(path, "w") as f:
        json.dump(data, f)
    os.utime(path, ns=(1, 1))  # another stamp, whatever the file system's clock resolution
    assert tuner.cached_config("NVIDIA H200", "b") is None  # within the interval: the memo
    clock[0] += tuning_cache.STAT_INTERVAL_S
    assert tuner.cached_config("NVIDIA H200", "b") == _tuned()
    tuner.store_entries("NVIDIA H200", {"c": entry})
    assert tuner.cached_config("NVIDIA H200", "c") == _tuned()


def test_the_cache_directory_follows_its_variables(monkeypatch, tmp_path):
    """cache_dir builds its path once per combination of UNIEP_CACHE_DIR, XDG_CACHE_HOME and HOME, and reads them on
    every call: a change of any is seen at once."""
    monkeypatch.delenv("UNIEP_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "uniep")
    monkeypatch.setenv("HOME", str(tmp_path / "other"))
    assert tuning_cache.cache_dir() == str(tmp_path / "other" / ".cache" / "uniep")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning_cache.cache_dir() == str(tmp_path / "xdg" / "uniep")
    monkeypatch.setenv("UNIEP_CACHE_DIR", str(tmp_path / "mine"))
    assert tuning_cache.cache_dir() == str(tmp_path / "mine")
    monkeypatch.delenv("UNIEP_CACHE_DIR")
    assert tuning_cache.cache_dir() == str(tmp_path / "xdg" / "uniep")
