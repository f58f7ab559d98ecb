"""The overlapped EP layer's knobs (OverlapConfig), their defaults, and the tuned knobs' lookup.

OverlapConfig holds every scheduling knob of the overlapped exchange: pipeline chunks, overlap on/off, the transfer
path (copy engines, the Triton transfer kernel, torch._foreach_copy_), the transfer kernel's programs and block, where
the results are pushed from, and the SM carve-out. None of them changes numerics: every value gives the same bits.
``timing`` is for benchmarks only and gives wrong results. The tuner (uniep_dynamo/tuner.py, tune_ep) searches them; its
winners live in the tuning cache (uniep_dynamo/tuning_cache.py), which ``cached_knobs`` reads when the layer runs.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch.distributed as dist

from ..spec import decode_spec


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """The EP scheduling knobs. None of them changes numerics."""
    # pipeline chunks per rank (each a run of whole local experts); at most E / W. None: CHUNKS_COPY_ENGINE where the
    # copy engines move the rows, CHUNKS_SM where the SMs do (each chunk costs those a transfer launch and the GEMMs'
    # launches a phase; 2 chunks beat 4 there in interleaved runs, BENCHMARKS.md session 17)
    chunks: int | None = None
    overlap: bool = True  # False: a phase's transfers all finish before its GEMMs (same results)
    # Transfers by the copy engines (True: no SMs taken from the GEMMs; one copy per (chunk, source), into a
    # stage ordered by source and put into expert order by one local row gather a chunk, the reverse before the
    # pushes), or on the SMs (False). None: the copy engines where a chunk holds at most COPY_ENGINE_SEGMENTS
    # (expert, source) pairs (chunks of one expert at a few ranks, as Mixtral's), else the SMs (BENCHMARKS.md).
    copy_engine: bool | None = None
    # On the SMs: uniep's Triton transfer kernel over a segment table on the device (True;
    # kernels/triton_transfer.py: one host call, copy_programs programs), or one torch._foreach_copy_ per
    # chunk (False; the segments sliced on the host, about 1100 slices a step on Qwen3-30B-A3B). Side by side
    # on H200s the kernel won at 2 and 4 ranks (BENCHMARKS.md); past MAX_PEERS ranks the foreach path runs.
    copy_kernel: bool = True
    # programs of the transfer kernel beside the GEMMs (alone, it takes every SM); None: COPY_PROGRAMS_PER_PEER per
    # peer rank (8 at 2 ranks, 24 at 4)
    copy_programs: int | None = None
    # elements a transfer program moves at a time (a power of two): a program waits for each block's loads from
    # the peer before it stores them, so the block sets how much of the link one program keeps busy. 32768 (64 KB
    # of bf16) with 24 programs at 4 ranks beat 8192 with 96 there: fewer SMs taken from the GEMMs beside the
    # transfers (BENCHMARKS.md session 20)
    copy_block: int = 32768
    copy_warps: int = 8  # warps of a transfer program
    # The backward's weight-gradient GEMMs: per chunk, after its input-gradient GEMM (False), or one grouped GEMM
    # over every local expert after the last chunk's input gradients (True: two launches instead of two a chunk,
    # beside the last pushes; faster on the Qwen3-30B-A3B shape at 2 ranks, BENCHMARKS.md). Each expert's gradient
    # is the same GEMM over the same rows either way.
    weight_grads_last: bool = True
    copy_streams: int = 1  # the copy engines: streams that a direction's copies of a chunk are spread over
    # Where the SMs move the rows (not the copy engines), the last GEMM of a chunk (the down projection; in the
    # backward the input gradient) stores its result rows straight into their sources' ``back`` (True; Triton's
    # GEMM, no push of its own), or into a buffer of this rank that a transfer then pushes (False; that GEMM may
    # run as torch._grouped_mm). Same values either way: the same tiles' results, stored elsewhere.
    push_in_gemm: bool = True
    # Benchmarks only, the results are wrong: "compute" skips the transfers, "comm" skips the GEMMs, to time
    # the two parts of the layer apart.
    timing: str = ""
    # The copy engines' copies of a chunk: one batched driver call (kernels/batch_copy.py) a stream over every
    # (expert, source) run, straight into expert order and back (True: no stage and no row gathers on the SMs), or
    # one copy per (chunk, source) through a stage (False). Same rows either way.
    batch_copies: bool = False
    # Chunk sizes: even (False), or tapered (True): the first chunk (whose pull no GEMM hides) and, past two chunks,
    # the last (whose push none hides) take half the experts of the others. Same rows and GEMMs per expert.
    taper: bool = False
    # With push_in_gemm, the chunks whose last GEMM stores into the peers: from chunk push_in_gemm_from on (a
    # negative value counts from the end: -1, the last chunk only). The earlier chunks' last GEMMs store into this
    # rank's buffer (torch._grouped_mm where the config asks) and the transfer kernel pushes their rows beside the
    # next chunk's GEMMs; the last chunk's push, which no GEMM would hide, stays in its GEMM. Same values.
    push_in_gemm_from: int = 0
    # The routing weights' gradient reads the forward's result rows, which the next call's pushes overwrite in the
    # window: a copy of them on a stream of its own, beside the work after the forward's combine (True, on CUDA;
    # every window barrier waits for it first), or by the combine as it reads them (False). Same rows either way.
    copy_back_beside: bool = True
    # The SMs for communication: where the transfer kernel's programs hold SMs beside a chunk's GEMMs (a later
    # chunk's pull, an earlier one's push), torch._grouped_mm (CUTLASS's persistent grouped GEMM, one CTA an SM) is
    # told to leave that many SMs out (torch's SM carve-out; True), so that no CTA of it waits for a held SM; or it
    # launches a CTA for every SM (False). Each tile is the same CTA's work over K in order either way: same bits.
    # The carve-out is torch's process-wide setting, set while the host issues the chunk's GEMMs and then restored.
    # Off by default: no difference above the noise at 2 ranks (BENCHMARKS.md session 24); the EP tuner searches it.
    gemm_carveout: bool = False

    def __post_init__(self):
        if self.timing not in ("", "compute", "comm"):
            raise ValueError(f"uniep: OverlapConfig.timing={self.timing!r}; expected '', 'compute' or 'comm'")
        if (self.chunks is not None and self.chunks < 1) \
                or (self.copy_programs is not None and self.copy_programs < 1) or self.copy_warps < 1 \
                or self.copy_streams < 1 \
                or self.copy_block < 16 \
                or self.copy_block & (self.copy_block - 1):
            raise ValueError(f"uniep: OverlapConfig needs chunks, copy_programs, copy_streams and copy_warps >= 1 "
                             f"and copy_block a power of two >= 16, got {self}")

    def chunk_experts(self, local_experts: int, world: int) -> int:
        """Local experts a chunk, for this many local experts at this EP size."""
        if self.chunks is not None:
            return max(1, math.ceil(local_experts / self.chunks))
        engine_chunk = max(1, math.ceil(local_experts / CHUNKS_COPY_ENGINE))
        if self._engine_at(engine_chunk, world):
            return engine_chunk
        return max(1, math.ceil(local_experts / CHUNKS_SM))

    def chunk_sizes(self, local_experts: int, world: int) -> tuple:
        """Local experts of each chunk, in order: chunk_experts() each (the last takes the rest), or with ``taper``
        as many chunks with weights 1, 2, ..., 2, 1 (two chunks: 1, 2), each at least one expert."""
        even = even_chunks(local_experts, self.chunk_experts(local_experts, world))
        n = len(even)
        if not self.taper or n < 2:
            return even
        weights = [1] + [2] * (n - 2) + [1 if n > 2 else 2]
        sizes, done, total = [], 0, sum(weights)
        for i, upto in enumerate(itertools.accumulate(weights)):
            end = round(local_experts * upto / total)
            end = min(max(end, done + 1), local_experts - (n - 1 - i))  # every chunk keeps an expert
            sizes.append(end - done)
            done = end
        return tuple(sizes)

    def _engine_at(self, chunk_experts: int, world: int) -> bool:
        if self.copy_engine is not None:
            return self.copy_engine
        return chunk_experts * world <= COPY_ENGINE_SEGMENTS

    def engine(self, local_experts: int, world: int) -> bool:
        """Whether the transfers run on the copy engines, for this many local experts at this EP size."""
        return self._engine_at(self.chunk_experts(local_experts, world), world)

    def layout_knobs(self, local_experts: int, world: int) -> tuple:
        """What a Layout needs of these knobs at this EP size: (local experts of each chunk, the transfer kernel's block
        where the kernel moves the rows, else None: no transfer table then, whether the copy engines move them,
        whether they do so in batches of (expert, source) runs). The transfer kernel addresses at most MAX_PEERS
        ranks' buffers; past that, torch._foreach_copy_ does."""
        from ..kernels.triton_transfer import MAX_PEERS

        engine = self.engine(local_experts, world)
        kernel = not engine and self.copy_kernel and world <= MAX_PEERS
        return (self.chunk_sizes(local_experts, world), self.copy_block if kernel else None, engine,
                engine and self.batch_copies)

    def gemm_pushes(self, local_experts: int, world: int) -> bool:
        """Whether the chunks' last GEMMs store their results into the sources' ``back`` themselves (push_in_gemm):
        where the SMs move the rows with overlap on, at most MAX_PEERS ranks (the scattering GEMM's peers), and
        the transfers are not skipped for timing."""
        from ..kernels.triton_transfer import MAX_PEERS

        return (self.push_in_gemm and self.overlap and not self.engine(local_experts, world)
                and world <= MAX_PEERS and self.timing == "")

    def first_gemm_push(self, chunks: int) -> int:
        """Of ``chunks`` pipeline chunks, the first whose last GEMM stores into the peers (where gemm_pushes)."""
        f = self.push_in_gemm_from
        return max(0, chunks + f) if f < 0 else min(f, chunks)

    def programs(self, world: int) -> int:
        """The transfer kernel's programs beside the GEMMs at this EP size."""
        return self.copy_programs if self.copy_programs is not None else COPY_PROGRAMS_PER_PEER * max(1, world - 1)


def even_chunks(local_experts: int, each: int) -> tuple:
    """Chunks of ``each`` local experts, the last taking the rest: each chunk's expert count, in order."""
    return tuple(min(each, local_experts - e0) for e0 in range(0, local_experts, each))


CHUNKS_COPY_ENGINE = 4  # OverlapConfig.chunks=None where the copy engines move the rows
CHUNKS_SM = 2  # OverlapConfig.chunks=None where the SMs move them
COPY_PROGRAMS_PER_PEER = 8  # OverlapConfig.copy_programs=None: the transfer kernel's programs per peer rank
COPY_ENGINE_SEGMENTS = 8  # OverlapConfig.copy_engine=None: copy engines up to this many (expert, source) pairs a chunk


def default_knobs(hidden, topk_ids, w_up, w_down, spec, group) -> OverlapConfig:
    """The tuned knobs of this shape and EP size from the tuning cache (written by uniep_dynamo/tuner.py's tune_ep), else the
    defaults. Ranks may pick differently (uneven token counts fall in other row buckets): the knobs only
    schedule each rank's own transfers and GEMMs, between the same collectives and barriers."""
    return cached_knobs(hidden, topk_ids.numel(), w_up, w_down, spec, group)


def cached_knobs(probe, rows: int, w_up, w_down, spec, group) -> OverlapConfig:
    """default_knobs for a rank that routes ``rows`` rows of ``probe``'s dtype, width and device."""
    if probe.device.type != "cuda":
        return OverlapConfig()
    from .. import tuning_cache

    key = ep_rows_key(probe.dtype, rows, probe.shape[1], w_up, w_down, spec, dist.get_world_size(group))
    return cached_ep_config(tuning_cache.gpu_name(probe.device), key) or OverlapConfig()


def ep_rows_key(dtype, rows: int, hidden: int, w_up, w_down, spec, world: int) -> str:
    """The tuning cache's key of one rank's EP layer from the rows it routes (T * K; what the compiled exchange
    sends): its routed rows times the EP size, all experts, H, I, EP size."""
    from .. import tuning_cache
    from ..kernels import reference

    spec = decode_spec(spec) if isinstance(spec, str) else spec
    inter = reference.effective_weight(w_down, spec.down_layout).shape[1]
    return tuning_cache.shape_key(dtype, rows * world, w_up.shape[0] * world, hidden, inter, ep_size=world)


def ep_config_to_dict(cfg) -> dict:
    """The tuning cache's entry of an OverlapConfig."""
    return {"ep_overlap": dataclasses.asdict(cfg)}


def cached_ep_config(gpu_name: str, key: str):
    """The tuned OverlapConfig for ``key`` (an ep_size > 1 shape_key) from the tuning cache, or None."""
    from .. import tuning_cache

    entry = tuning_cache.entry(gpu_name, key)
    if entry is None or "ep_overlap" not in entry:
        return None
    try:
        cfg = OverlapConfig(**entry["ep_overlap"])
        if cfg.timing:
            raise ValueError("a timing-only config")
        return cfg
    except (TypeError, ValueError) as exc:
        tuning_cache.log.warning("uniep: ignoring the tuning cache entry %s (%s)", key, exc)
        return None


def knobs_from_json(text: str) -> OverlapConfig | None:
    """OverlapConfig from the JSON object of its fields the compile rewrite passes; None for "" (the tuned
    knobs of the call's shape from the tuning cache, else the defaults: exchange_forward/backward look)."""
    if not text:
        return None
    import json

    fields = json.loads(text)
    if not isinstance(fields, dict) or "timing" in fields:
        raise ValueError(f"uniep: EP overlap knobs {text!r} must be a JSON object of OverlapConfig's scheduling "
                         "fields")
    return OverlapConfig(**fields)
