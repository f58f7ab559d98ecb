"""The tuning cache on disk: where it lives, its format, and its reads and writes.

The tuner (tuner.py) writes it; the kernels' config lookup (kernels/config.py) and the EP layer's knob lookup
(ep/config.py) read it when an op runs. This module sits below all of them and imports nothing of uniep but the
version, so the kernels never import the tuner: entries come back as plain JSON objects, which the reader turns
into its own config type.

One JSON file per (uniep, torch, triton, GPU model) under ``$XDG_CACHE_HOME/uniep`` (default ``~/.cache/uniep``;
``UNIEP_CACHE_DIR`` overrides), entries keyed by ``shape_key``: dtype, E, H, I, the routed-row count rounded up to
a power of two, and the EP size. Writers (several ranks tuning at once) take an exclusive lock on a side file and
replace the JSON atomically, merging what is there. A file that does not parse is ignored with a warning; a missing
entry never blocks (the heuristics or defaults apply); ``UNIEP_TUNE=0`` ignores the cache.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time

import torch

log = logging.getLogger("uniep")

CACHE_FORMAT = 1


_DIRS: dict = {}  # (UNIEP_CACHE_DIR, XDG_CACHE_HOME, HOME) -> the cache directory they name


def cache_dir() -> str:
    """UNIEP_CACHE_DIR, else $XDG_CACHE_HOME/uniep, else ~/.cache/uniep: read from the variables on every call (the
    ops look their config up on every call), the path built once per combination of them (``expanduser`` took a
    third of a lookup's host time)."""
    key = (os.environ.get("UNIEP_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))
    root = _DIRS.get(key)
    if root is None:
        root = _DIRS[key] = key[0] or os.path.join(key[1] or os.path.join(os.path.expanduser("~"), ".cache"),
                                                   "uniep")
    return root


_PATHS: dict = {}  # (gpu name, cache dir, versions) -> cache file


@functools.lru_cache(maxsize=1)
def versions() -> tuple:
    """(uniep, torch, triton) versions: a cache file holds the entries of one combination."""
    from .version import __version__
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return __version__, torch.__version__, triton_version


def cache_path(gpu_name: str) -> str:
    """The cache file of this GPU, uniep, torch and triton (the compiled ops look it up on every call)."""
    found = versions()
    key = (gpu_name, cache_dir(), found)
    path = _PATHS.get(key)
    if path is None:
        uniep_v, torch_v, triton_v = found
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in gpu_name)
        path = _PATHS[key] = os.path.join(key[1], f"tune-uniep{uniep_v}-torch{torch_v}-triton{triton_v}",
                                          f"{safe}.json")
    return path


def shape_key(dtype: torch.dtype, num_rows: int, num_experts: int, hidden: int, inter: int, ep_size: int = 1) -> str:
    bucket = 1 << max(num_rows - 1, 0).bit_length()
    return f"{str(dtype).replace('torch.', '')}/E{num_experts}/H{hidden}/I{inter}/rows<={bucket}/ep{ep_size}"


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError("not a uniep tuning cache of this format")
        return data["entries"]
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("uniep: ignoring the tuning cache %s (%s); the heuristics apply", path, exc)
        return {}


_MEMO: dict = {}  # path -> (its modification stamp, its entries, when the stamp was last read: time.monotonic())
# The compiled ops look their config up on every call: the file's stamp is read at most this often, not with a stat
# a call (about 1% of a decode-sized op call's host time). A write by this process (store_entries) is seen at once;
# one by another process (a tuner running beside) within this many seconds.
STAT_INTERVAL_S = 1.0


def load_entries(gpu_name: str) -> dict:
    """Every entry of this GPU's cache file, read again only when the file changed."""
    path = cache_path(gpu_name)
    memo = _MEMO.get(path)
    now = time.monotonic()
    if memo is not None and now - memo[2] < STAT_INTERVAL_S:
        return memo[1]
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = None
    if memo is None or memo[0] != stamp:
        memo = (stamp, _read(path) if stamp is not None else {}, now)
    else:
        memo = (stamp, memo[1], now)
    _MEMO[path] = memo
    return memo[1]


def store_entries(gpu_name: str, entries: dict) -> str:
    """Merge ``entries`` into the cache file under an exclusive lock, replacing it atomically."""
    import fcntl

    path = cache_path(gpu_name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            merged = _read(path)
            merged.update(entries)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"format": CACHE_FORMAT, "versions": list(versions()), "gpu": gpu_name,
                           "entries": merged}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _MEMO.pop(path, None)
    return path


def entry(gpu_name: str, key: str) -> dict | None:
    """The cache entry of ``key`` for this GPU (a JSON object), or None: none stored, or UNIEP_TUNE=0."""
    if os.environ.get("UNIEP_TUNE", "1") == "0":
        return None
    return load_entries(gpu_name).get(key)


_GPU_NAMES: dict = {}


def gpu_name(device) -> str:
    """The model name of a CUDA device (what the cache files are named by), read once per device index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _GPU_NAMES:
        _GPU_NAMES[index] = torch.cuda.get_device_name(index)
    return _GPU_NAMES[index]
