"""Expert parallelism with the token transfers overlapped with the grouped GEMMs, through torch symmetric
memory.

The sequential EP layer (ep.py) runs dispatch all-to-all, experts, combine all-to-all one after the
other. Here every rank keeps two rows buffers in symmetric memory, ``send`` and ``back``, which every
peer can address; the transfers are copies out of a peer's ``send`` (pull) and into a peer's ``back``
(push), on their own CUDA streams: copy-engine copies (no SMs taken from the GEMMs), or SM copies
(torch._foreach_copy_, or the Triton transfer kernel of kernels/triton_transfer.py); OverlapConfig picks.

Where each row goes comes from the routing plan alone, never from arrival order:

    table       each rank's per-expert row counts and token count, all-gathered ([W, E + 1] integers;
                the one host synchronization, as in the sequential path)
    send        the source writes its rows in plan order, (global expert, token, k), into its ``send``
    receive     rank r lays out its local experts' rows expert-major, and within an expert by
                (source rank, token, k): the single-GPU op's order over all ranks' tokens
    chunks      the local experts are cut into chunks; a chunk holds every row of its experts, so its
                up and down GEMMs, and in the backward its input-gradient and weight-gradient GEMMs, are
                the single-GPU op's GEMMs over those experts, in the same row order
    pipeline    chunk c's rows are pulled (one copy per (expert, source) segment) while chunk c - 1
                computes; chunk c's results are pushed back to their sources' ``back`` while chunk
                c + 1 computes (where the SMs move the rows, by the chunk's last GEMM itself: its epilogue
                stores each row into its source's ``back``, OverlapConfig.push_in_gemm)
    combine     after a barrier, the source sums each token's K rows from its ``back``, k in order, fp32

The backward runs the same way: the weighted output-gradient rows are the dispatched rows, the input
gradient rows come back, and each chunk's weight gradients follow its input-gradient GEMM. For one tile
configuration, outputs and all gradients are bitwise those of the single-GPU op over all ranks' tokens
(each rank holding a contiguous shard of the tokens); the chunk size and overlap on/off only schedule.

On CPU (CI) the same code runs in Triton's interpreter with a stand-in for symmetric memory: each rank's
buffers are a shared file that every process maps, and the barrier is a gloo barrier.
"""
from __future__ import annotations

import array
import contextlib
import ctypes
import dataclasses
import functools
import itertools
import math
import os
import tempfile
import uuid

import torch
import torch.distributed as dist

from .spec import decode_spec


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
        even = _even_chunks(local_experts, self.chunk_experts(local_experts, world))
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
        """What a _Layout needs of these knobs at this EP size: (local experts of each chunk, the transfer kernel's block
        where the kernel moves the rows, else None: no transfer table then, whether the copy engines move them,
        whether they do so in batches of (expert, source) runs). The transfer kernel addresses at most MAX_PEERS
        ranks' buffers; past that, torch._foreach_copy_ does."""
        from .kernels.triton_transfer import MAX_PEERS

        engine = self.engine(local_experts, world)
        kernel = not engine and self.copy_kernel and world <= MAX_PEERS
        return (self.chunk_sizes(local_experts, world), self.copy_block if kernel else None, engine,
                engine and self.batch_copies)

    def gemm_pushes(self, local_experts: int, world: int) -> bool:
        """Whether the chunks' last GEMMs store their results into the sources' ``back`` themselves (push_in_gemm):
        where the SMs move the rows with overlap on, at most MAX_PEERS ranks (the scattering GEMM's peers), and
        the transfers are not skipped for timing."""
        from .kernels.triton_transfer import MAX_PEERS

        return (self.push_in_gemm and self.overlap and not self.engine(local_experts, world)
                and world <= MAX_PEERS and self.timing == "")

    def first_gemm_push(self, chunks: int) -> int:
        """Of ``chunks`` pipeline chunks, the first whose last GEMM stores into the peers (where gemm_pushes)."""
        f = self.push_in_gemm_from
        return max(0, chunks + f) if f < 0 else min(f, chunks)

    def programs(self, world: int) -> int:
        """The transfer kernel's programs beside the GEMMs at this EP size."""
        return self.copy_programs if self.copy_programs is not None else COPY_PROGRAMS_PER_PEER * max(1, world - 1)


def _even_chunks(local_experts: int, each: int) -> tuple:
    """Chunks of ``each`` local experts, the last taking the rest: each chunk's expert count, in order."""
    return tuple(min(each, local_experts - e0) for e0 in range(0, local_experts, each))


class _Layout:
    """Where every row of one call lives, from the all-gathered table (host integers).

    counts[s][g]: rows source s sends to global expert g; tokens[s]: source s's tokens; chunk: local experts a
    chunk (the last takes the rest), or each chunk's, in order (OverlapConfig.chunk_sizes); width: the elements
    of a row (every transfer of the layer moves [*, hidden] rows); block: the transfer kernel's block, None
    when the call does not use the kernel (no table then); engine: whether the copy engines move the rows
    (the per-(chunk, source) blocks and the stage permutations then, unless ``batched``: their copies are then the
    (expert, source) segments themselves, in batches, and no chunk is staged). device_counts: the same table on the
    device ([W, >= E] integers, the counts in its first E columns), or None: with it, to_device makes the device
    tables by one Triton launch (kernels.layout_tables) where it can, instead of laying them out on the host.

    The layout is made between the count table's synchronization and the step's first pull, with the GPU idle:
    the constructor keeps to what every call needs (the chunks' rows); the host tables (segments, the transfer
    table, the destinations' runs) are made when asked for."""

    def __init__(self, counts, tokens, top_k: int, rank: int, world: int, local_experts: int, chunk: int | tuple,
                 width: int, block: int | None, engine: bool = False, batched: bool = False, device_counts=None):
        self.rank, self.world, self.block, self.engine = rank, world, block, engine
        self.local_experts, self.width = local_experts, width
        self.batched = engine and batched
        self._counts, self._device_counts = counts, device_counts
        self._batches = {}  # batches(): per (chunk, streams, row bytes)
        self._on_device = {}  # to_device's tensors, per device
        first = rank * local_experts
        # this rank's (expert, source) pairs in receive order: their rows, and (at[i]) where they start in the
        # receive buffer
        self._mine = self._by_pair(counts)
        self._at = at = [0, *itertools.accumulate(self._mine)]
        self.expert_end = at[world::world]  # each local expert's end row
        self.rows = at[-1]
        self.capacity = max(t * top_k for t in tokens)
        self.total_rows = sum(t * top_k for t in tokens)
        self.chunks = []  # (first local expert, end, first row, end row)
        sizes = chunk if isinstance(chunk, tuple) else _even_chunks(local_experts, chunk)
        if sum(sizes) != local_experts or min(sizes, default=1) < 1:
            raise ValueError(f"uniep: chunks of {sizes} experts do not cut {local_experts} local experts")
        for e0, e1 in zip((0,) + tuple(itertools.accumulate(sizes)), itertools.accumulate(sizes)):
            self.chunks.append((e0, e1, at[e0 * world], self.expert_end[e1 - 1]))
        # with a block, the transfer kernel's table (to_device): a row per (expert, source) pair, rows of none
        # included, chunk by chunk, in each chunk source by source (this rank first), then expert by expert; per
        # chunk (its first table row, its table rows)
        self.table_chunks = [(world * e0, world * (e1 - e0)) for e0, e1, _, _ in self.chunks] \
            if block is not None else []
        # The copy engines move a chunk as one copy per source: source s's rows for the chunk's experts are one run
        # of its buffer (plan order is expert-major). On this rank they land in a stage ordered by source, then
        # expert (stage row: source s's block start + the row's place in the run), and one row gather puts them
        # into the receive order; before a push, the reverse gather puts the results back in stage order.
        # blocks[c]: (source, row in its buffer, row in the stage, rows) per source with rows, this rank first;
        # staged[c]: whether chunk c's stage order differs from its receive order (one expert or one source: no).
        self.blocks, self.staged = [], []
        # the permutations, as runs of (delta, rows): receive row i -> its row in the chunk's stage, i + delta; stage
        # row j of a chunk whose first row is lo -> its row counted from lo in the receive order, lo + j + delta
        self._perm_runs, self._inv_runs = ([], []), ([], [])
        order = [(rank + j) % world for j in range(world)]
        for e0, e1, lo, _ in self.chunks if engine and not self.batched else ():
            per_source = [sum(counts[s][first + e0:first + e1]) for s in range(world)]
            stage_start = [sum(per_source[:s]) for s in range(world)]
            self.blocks.append([(s, self.send_start[s][first + e0], stage_start[s], per_source[s]) for s in order
                                if per_source[s]])
            by_expert = [(e, s) for e in range(e0, e1) for s in range(world) if counts[s][first + e]]
            by_source = [(e, s) for s in range(world) for e in range(e0, e1) if counts[s][first + e]]
            self.staged.append(by_expert != by_source)

            def stage_row(e, s):  # the first stage row (counted from the chunk's) of source s's rows for expert e
                return stage_start[s] + self.send_start[s][first + e] - self.send_start[s][first + e0]

            for e, s in by_expert:  # indexed by the absolute receive row
                self._perm_runs[0].append(stage_row(e, s) - self.recv_start[e][s])
                self._perm_runs[1].append(counts[s][first + e])
            for e, s in by_source:  # indexed by lo + the stage row; gives the receive row counted from lo
                self._inv_runs[0].append((self.recv_start[e][s] - lo) - (lo + stage_row(e, s)))
                self._inv_runs[1].append(counts[s][first + e])
        if self.batched:
            self.staged = [False] * len(self.chunks)

    @functools.cached_property
    def send_start(self):
        """send_start[s][g]: where source s's rows for global expert g start in its plan order (= its ``send`` and
        ``back`` buffers); send_start[s][-1]: its rows."""
        return [[0, *itertools.accumulate(row)] for row in self._counts]

    @functools.cached_property
    def recv_start(self):
        """recv_start[e][s]: where local expert e's rows from source s start in the receive buffer."""
        return [self._at[i:i + self.world] for i in range(0, len(self._mine), self.world)]

    def chunk_ends(self, c: int) -> list:
        """Chunk c's local experts' end rows, counted from the chunk's first row (its grouped GEMMs' offsets)."""
        e0, e1, lo, _ = self.chunks[c]
        return [end - lo for end in self.expert_end[e0:e1]]

    def _by_pair(self, table) -> list:
        """table[s][g] (a row per source over the global experts) for each of this rank's (expert, source) pairs in
        receive order (expert-major): pair i = e * world + s."""
        first = self.rank * self.local_experts
        return [v for pairs in zip(*(row[first:first + self.local_experts] for row in table)) for v in pairs]

    @functools.cached_property
    def _peer(self):
        """Per (expert, source) pair in receive order: where its rows start in the source's buffer."""
        return self._by_pair(self.send_start)

    def _pairs(self, c: int):
        """Chunk c's (source, row in its buffer, row in the chunk, rows) per (expert, source) pair, pairs without
        rows included, in the transfer table's order."""
        e0, e1, lo, _ = self.chunks[c]
        world, peer, at, mine = self.world, self._peer, self._at, self._mine
        return [(s, peer[i], at[i] - lo, mine[i]) for s in ((self.rank + j) % world for j in range(world))
                for i in range(e0 * world + s, e1 * world, world)]

    @functools.cached_property
    def segments(self):
        """Per chunk: (source, row in the source's buffer, row in the chunk, rows) for each (expert, source) with
        rows, this rank's own rows first; every transfer of the call (both directions, forward and backward). A
        chunk's rows are a slice of the receive buffer (pulls) or a [chunk rows, H] tensor of its own (pushes)."""
        return [[pair for pair in self._pairs(c) if pair[3]] for c in range(len(self.chunks))]

    def _dest_runs(self) -> list:
        """Where the SMs move the rows (at most MAX_PEERS ranks), each receive row's destination as runs in receive
        order, one a pair, flat (first row, delta, rows) triples: receive row i goes back to row i + delta // 8 of
        source delta % 8 (destinations(); the scattering GEMMs' table). Else none."""
        from .kernels.triton_transfer import MAX_PEERS

        if self.engine or self.world > MAX_PEERS:
            return []
        at, world = self._at, self.world
        return [v for i, (p, n) in enumerate(zip(self._peer, self._mine))
                for v in (at[i], (p - at[i]) * 8 + i % world, n)]

    def _table(self) -> list:
        """The transfer kernel's table on the host, flat (kernels.segment_table), chunk after chunk."""
        from .kernels.triton_transfer import segment_table

        table = []
        for c in range(len(self.chunks)):
            table += segment_table(self._pairs(c), self.width, self.block)[0]
        return table

    def batches(self, c: int, lanes: int, row_bytes: int):
        """Chunk c's segments as byte offsets, for the batched copies (``lanes`` streams; a source's runs stay on
        one): per lane, (sources, offsets into the sources' buffers, offsets into the chunk's local rows, sizes).
        Made once per (chunk, lanes, row bytes); a pull and a push read the same offsets."""
        key = (c, lanes, row_bytes)
        if key not in self._batches:
            per_lane = [([], [], [], []) for _ in range(lanes)]
            sources = []
            for s, peer_row, row, n in self.segments[c]:
                if s not in sources:
                    sources.append(s)
                lane = per_lane[sources.index(s) % lanes]
                lane[0].append(s)
                lane[1].append(peer_row * row_bytes)
                lane[2].append(row * row_bytes)
                lane[3].append(n * row_bytes)
            self._batches[key] = [lane for lane in per_lane if lane[0]]
        return self._batches[key]

    def destinations(self, device):
        """[rows] int64 on the device: where each receive row's result goes back, (row in its source's buffer) * 8
        + source (the scattering GEMMs' table; a layout of the SMs' transfers at most MAX_PEERS ranks). Made once
        per device from to_device's copy, without a host synchronization."""
        key = ("destinations", str(device))
        if key not in self._on_device:
            self._on_device[key] = self._expand(device, "dest", scale=8)
        return self._on_device[key]

    def to_device(self, device):
        """One host-to-device copy: ([E_local] int64, each local expert's end row counted from its chunk's
        first row: the grouped GEMMs' offsets, sliced per chunk; [n, 5] int64, the transfer table). Made once per
        device: a cached exchange layout serves the forward and the backward (the kernels only read them)."""
        copied = self._copied(device)
        return copied["rel"], copied["table"]

    def ends(self, device):
        """[E_local] int64 on the device: each local expert's end row (the offsets of a GEMM over every chunk)."""
        return self._copied(device)["ends"]

    def permutations(self, device):
        """([rows] int64, [rows] int64) on the device: for each receive row, its row in its chunk's stage; for
        each stage row (the chunk's first row plus the row in its stage), its row in the chunk's receive order.
        Made once per device from to_device's copy, without a host synchronization."""
        key = ("permutations", str(device))
        if key not in self._on_device:
            self._on_device[key] = (self._expand(device, "perm"), self._expand(device, "inv"))
        return self._on_device[key]

    def _expand(self, device, name: str, scale: int = 1):
        """[rows] int64: row i * scale + the delta of the run (of the ``name`` runs, in row order) that holds row i.
        One Triton launch on the GPU (and in the interpreter), torch ops on the CPU otherwise."""
        from .kernels.config import interpreting
        from .kernels.triton_transfer import expand_runs

        runs = self._copied(device)[name + "_runs"]
        if device.type == "cuda" or interpreting():
            return expand_runs(runs, self.rows, scale)
        rows = torch.arange(self.rows, device=device)
        return (rows * scale if scale != 1 else rows) + torch.repeat_interleave(runs[:, 1], runs[:, 2],
                                                                                output_size=self.rows)

    def _copied(self, device):
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = self._copy_to(device)
        return self._on_device[key]

    def _copy_to(self, device):
        """Every table of the layout on the device: {name: its int64 tensor}. From the device's count table by one
        launch where the transfer kernel moves the rows (kernels.layout_tables), else from the host tables in one
        host-to-device copy."""
        from .kernels.config import interpreting
        from .kernels.triton_transfer import MAX_CHUNKS, MAX_PEERS, TABLE_COLUMNS, layout_tables

        counts = self._device_counts
        if (counts is not None and counts.device == device and self.block is not None and self.world <= MAX_PEERS
                and len(self.chunks) <= MAX_CHUNKS and (device.type == "cuda" or interpreting())):
            rel, ends, dest, table = layout_tables(counts, self.rank, self.local_experts,
                                                   [e0 for e0, _, _, _ in self.chunks], self.width, self.block)
            none = ends[:0].view(-1, 3)
            return {"rel": rel, "ends": ends, "dest_runs": dest, "perm_runs": none, "inv_runs": none, "table": table}
        rel = [end for c in range(len(self.chunks)) for end in self.chunk_ends(c)]
        sections = {"rel": rel, "ends": self.expert_end, "dest_runs": self._dest_runs(),
                    "perm_runs": _runs(*self._perm_runs), "inv_runs": _runs(*self._inv_runs),
                    "table": self._table() if self.block is not None else []}
        # one int64 array of every section, copied into pinned memory by one memmove (torch.tensor on a list takes
        # three times as long)
        flat = array.array("q", [v for values in sections.values() for v in values])
        every = torch.empty(len(flat), dtype=torch.int64, pin_memory=device.type == "cuda")
        if flat:
            ctypes.memmove(every.data_ptr(), flat.buffer_info()[0], len(flat) * flat.itemsize)
        every = every.to(device, non_blocking=True)
        copied, at = {}, 0
        for name, values in sections.items():
            copied[name] = every[at:at + len(values)]
            at += len(values)
        copied["table"] = copied["table"].view(-1, TABLE_COLUMNS)
        for name in ("dest_runs", "perm_runs", "inv_runs"):
            copied[name] = copied[name].view(-1, 3)
        return copied


def _runs(deltas, rows) -> list:
    """Runs of (delta, rows) in row order, flat as (first row, delta, rows) triples (kernels.expand_runs)."""
    flat, at = [], 0
    for delta, n in zip(deltas, rows):
        flat += (at, delta, n)
        at += n
    return flat


class _Window:
    """This rank's ``send`` and ``back`` row buffers ([capacity, H] each) where every peer can read and
    write them, and a barrier over the group."""

    def __init__(self, group, capacity: int, hidden: int, dtype, device):
        self.capacity, self.hidden, self.dtype = capacity, hidden, dtype
        world = dist.get_world_size(group)
        numel = 2 * capacity * hidden
        if device.type == "cuda":
            import torch.distributed._symmetric_memory as symm_mem

            self._buffer = symm_mem.empty(numel, dtype=dtype, device=device)
            self._handle = symm_mem.rendezvous(self._buffer, group.group_name)
            self._views = [self._handle.get_buffer(p, (2, capacity, hidden), dtype, 0) for p in range(world)]
            self._barrier = lambda: self._handle.barrier(channel=0)
        else:
            # CPU stand-in: one shared file per rank, mapped by every process of the group
            name = [uuid.uuid4().hex]
            dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
            root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            paths = [os.path.join(root, f"uniep-ep-{name[0]}-{p}") for p in range(world)]
            mine = paths[dist.get_rank(group)]
            with open(mine, "wb") as f:
                f.truncate(max(numel, 1) * torch.empty((), dtype=dtype).element_size())
            dist.barrier(group=group)
            self._views = [torch.from_file(p, shared=True, size=max(numel, 1), dtype=dtype)[:numel]
                           .view(2, capacity, hidden) for p in paths]
            dist.barrier(group=group)
            os.unlink(mine)  # the mappings stay
            self._barrier = lambda: dist.barrier(group=group)

    def send(self, rank: int) -> torch.Tensor:
        return self._views[rank][0]

    def back(self, rank: int) -> torch.Tensor:
        return self._views[rank][1]

    def barrier(self) -> None:
        _wait_reads()  # no peer writes a ``back`` before this barrier: the copies out of them come first
        self._barrier()


_WINDOWS: dict = {}
# (event, rows): copies out of a window's ``back`` on a stream of their own (_copy_back), which no barrier may pass
_READS: list = []


def _wait_reads() -> None:
    for event, _ in _READS:
        torch.cuda.current_stream().wait_event(event)
    _READS.clear()


def _copy_back(rows: torch.Tensor, out: torch.Tensor):
    """out <- rows (rows of a window's ``back``) on the device's copy-back stream, after the current stream's
    work, beside the work that follows; returns the event that a reader of ``out`` waits for. The next barrier
    of any window waits for it first (_Window.barrier): the peers write ``back`` only after a phase's first
    barrier, so the rows stay put until they are copied."""
    current = torch.cuda.current_stream(rows.device)
    stream = _COPY_BACK.get(str(rows.device))
    if stream is None:
        stream = _COPY_BACK[str(rows.device)] = torch.cuda.Stream(rows.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        out.copy_(rows)
    out.record_stream(stream)
    done = torch.cuda.Event()
    done.record(stream)
    _READS.append((done, rows))
    return done


_COPY_BACK: dict = {}


def _window_key(group, dtype, hidden: int, device):
    return (group.group_name if hasattr(group, "group_name") else id(group), dtype, hidden, str(device))


def _window(group, capacity: int, hidden: int, dtype, device) -> _Window:
    """The cached window of this group, dtype and width, grown (to a power of two rows) when a call needs
    more. Every rank takes the same decision: the capacity comes from the all-gathered table."""
    key = _window_key(group, dtype, hidden, device)
    win = _WINDOWS.get(key)
    if win is None or win.capacity < capacity:
        for event, _ in _READS:  # the old window's memory goes once no copy reads it
            event.synchronize()
        win = _Window(group, 1 << max(capacity - 1, 0).bit_length(), hidden, dtype, device)
        _WINDOWS[key] = win
    return win


_TIMING_ROWS: dict = {}


def _receive_buffer(role: str, rows: int, hidden: int, dtype, device, knobs: "OverlapConfig") -> torch.Tensor:
    """A phase's receive buffer. With timing="compute" (no transfers) a cached one of random values instead:
    the GEMMs see real-looking inputs (zeros draw less power and run faster), at no cost per call."""
    if knobs.timing != "compute":
        return torch.empty(rows, hidden, dtype=dtype, device=device)
    buf = _TIMING_ROWS.get(role)
    if buf is None or buf.shape != (rows, hidden) or buf.dtype != dtype or buf.device != device:
        buf = _TIMING_ROWS[role] = torch.randn(rows, hidden, device=device).to(dtype)
    return buf


class _Streams:
    """The pull and push streams of a device (CUDA): ``pulls`` and ``pushes``, ``count`` of each (the copy engines'
    copies of a chunk spread over them), ``pull`` and ``push`` the first; on CPU every copy runs in place, in order.
    The stream current when the phase starts is read once: the host issues a phase's launches one after another,
    and each stream switch or event through torch.cuda's helpers reads the current stream again (tens of µs a
    chunk)."""

    _cache: dict = {}

    def __init__(self, device, count: int = 1):
        self.cuda = device.type == "cuda"
        self.pull = self.push = self.current = None
        self.pulls, self.pushes = [None] * count, [None] * count
        if self.cuda:
            key = str(device)
            made = self._cache.setdefault(key, [])
            while len(made) < 2 * count:
                made.append(torch.cuda.Stream(device))
            self.pulls, self.pushes = made[0:2 * count:2], made[1:2 * count:2]
            self.pull, self.push = self.pulls[0], self.pushes[0]
            self.current = torch.cuda.current_stream(device)
            # set_stream switches the current stream of the stream's device: the device must be current
            self._switch = device.index is None or device.index == torch.cuda.current_device()

    def on(self, stream):
        if not self.cuda:
            return contextlib.nullcontext()
        return _On(stream, self.current) if self._switch else torch.cuda.stream(stream)

    def record(self, stream=None):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream if stream is not None else self.current)
        return event

    def wait(self, event, stream=None):
        """``stream`` (the current one by default) waits for the event, or for each of a list of them."""
        for e in event if isinstance(event, list) else [event]:
            if e is not None:
                (stream if stream is not None else self.current).wait_event(e)

    def join(self):
        if self.cuda:
            for stream in self.pulls + self.pushes:
                self.current.wait_stream(stream)

    def start_after_current(self):
        if self.cuda:
            for stream in self.pulls + self.pushes:
                stream.wait_stream(self.current)


class _On:
    """``with torch.cuda.stream(stream)`` for a stream of the current device, back to ``back`` after."""

    __slots__ = ("stream", "back")

    def __init__(self, stream, back):
        self.stream, self.back = stream, back

    def __enter__(self):
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc):
        torch.cuda.set_stream(self.back)


def _start_exchange(layout: _Layout, table: torch.Tensor, win_out: _Window, win_in: _Window, recv: torch.Tensor,
                    knobs: OverlapConfig, device):
    """The pipeline of one phase, started: issues the first chunks' pulls (out of the peers' ``send`` of win_out
    into recv) and returns run(compute, after=None), which does the rest. The caller does the host work that the
    first pulls need not wait for (the GEMMs' set-up) between the two: right after the count table's
    synchronization the GPU idles until the first pull is issued.

    run pulls every further chunk, runs compute(chunk, scatter) -> the chunk's result rows ([chunk rows, H], or
    None), pushes those rows into the sources' ``back`` of win_in; then after() (work that no transfer waits
    for, beside the last pushes). It ends with a barrier: every rank's ``back`` is complete and no one reads a
    ``send`` any more. ``scatter``: None, or (the layout's destinations, the sources' ``back``) for a compute that
    stores its results there itself (OverlapConfig.push_in_gemm) and returns None.

    The host issues chunk c + LOOKAHEAD's pulls after chunk c's GEMMs, so the first GEMMs start before
    every copy has been issued. ``table``: the layout's transfer table on the device."""
    from .kernels import batch_copy
    from .kernels.triton_transfer import copy_segments

    transfer = knobs.timing != "compute"
    # the paths the layout was laid out for (OverlapConfig.layout_knobs): the copy engines, the transfer kernel
    # (a block: its table), else torch._foreach_copy_
    copy_engine, kernel = layout.engine, layout.block is not None
    num_chunks = len(layout.chunks)
    sends = [win_out.send(s) for s in range(layout.world)]
    backs = [win_in.back(s) for s in range(layout.world)]
    pulled = []
    pushed = []  # the result rows, alive until the push stream is joined (their memory is not reused before)
    ahead = num_chunks if not knobs.overlap else min(num_chunks, LOOKAHEAD)

    # the copy engines' stages: chunk c is pulled into slot c % slots, which its row gather frees for chunk c + slots
    staged = [copy_engine and transfer and layout.staged[c] for c in range(num_chunks)]
    stage, freed, perm, inv = [], [None] * ahead, None, None
    if any(staged):
        perm, inv = layout.permutations(device)
        most = max(hi - lo for (_, _, lo, hi), st in zip(layout.chunks, staged) if st)
        stage = torch.empty(ahead, most, recv.shape[1], dtype=recv.dtype, device=device)

    streams = _Streams(device, knobs.copy_streams if copy_engine else 1)
    streams.start_after_current()

    # a transfer no GEMM runs beside (the first pull, the last push, all of them without overlap) takes every SM
    programs = knobs.programs(layout.world)
    solo_programs = max(programs, _sm_count(device))

    def move(c, local, peers, push):
        if not transfer:
            return
        if not kernel:
            _segment_copies(layout.segments[c], local, peers, push)
        elif layout.chunks[c][3] > layout.chunks[c][2]:  # the chunk has rows
            first, rows = layout.table_chunks[c]
            solo = not knobs.overlap or c == (num_chunks - 1 if push else 0)
            copy_segments(table[first:first + rows], local, peers, push, solo_programs if solo else programs,
                          knobs.copy_block, knobs.copy_warps)

    def engine_copies(c, local, peers, push, after):
        """The copy engines' copies of chunk c, one per source (or its batches of (expert, source) runs), spread
        over the streams of the direction, each of which first waits for ``after``; returns the events of the
        streams that copied."""
        lanes = streams.pushes if push else streams.pulls
        if layout.batched:
            return batched_copies(c, local, peers, push, after, lanes)
        done = []
        for i, (s, peer_row, row, n) in enumerate(layout.blocks[c] if transfer else ()):
            lane = lanes[i % len(lanes)]
            if i < len(lanes):
                streams.wait(after, lane)
            with streams.on(lane):
                if push:
                    peers[s][peer_row:peer_row + n].copy_(local[row:row + n])
                else:
                    local[row:row + n].copy_(peers[s][peer_row:peer_row + n])
            if i + len(lanes) >= len(layout.blocks[c]):  # the lane's last copy of the chunk
                done.append(streams.record(lane))
        return done

    def batched_copies(c, local, peers, push, after, lanes):
        if not transfer:
            return []
        if not streams.cuda or not batch_copy.available():  # CPU, or a driver without batches: one copy a run
            with streams.on(lanes[0]):
                streams.wait(after, lanes[0])
                _segment_copies(layout.segments[c], local, peers, push)
                return [streams.record(lanes[0])]
        if not local.is_contiguous():
            raise ValueError("uniep: the batched copies take contiguous chunk rows")
        done, bases, here = [], [p.data_ptr() for p in peers], local.data_ptr()
        for lane, (sources, peer_at, local_at, sizes) in zip(lanes, layout.batches(
                c, len(lanes), local.shape[1] * local.element_size())):
            streams.wait(after, lane)
            there = [bases[s] + at for s, at in zip(sources, peer_at)]
            mine = [here + at for at in local_at]
            batch_copy.copy_batch(there if push else mine, mine if push else there, sizes, lane.cuda_stream)
            done.append(streams.record(lane))
        return done

    def pull(c):
        _, _, lo, hi = layout.chunks[c]
        local = stage[c % ahead][:hi - lo] if staged[c] else recv[lo:hi]
        if copy_engine:  # after the slot's last chunk was gathered out of the stage
            pulled.append(engine_copies(c, local, sends, False, freed[c % ahead] if staged[c] else None))
            return
        with streams.on(streams.pull):
            move(c, local, sends, push=False)
            pulled.append(streams.record(streams.pull))

    def push(c, rows, done):
        if copy_engine:
            engine_copies(c, rows, backs, True, done)
        else:
            streams.wait(done, streams.push)
            with streams.on(streams.push):
                move(c, rows, backs, push=True)
        pushed.append(rows)

    for c in range(ahead):
        pull(c)

    def run(compute, after=None):
        # the last GEMM of a chunk stores its rows into the sources' ``back`` itself (OverlapConfig.gemm_pushes);
        # their table is built after the first pulls are issued, which do not read it
        scatter = (layout.destinations(device), backs) if knobs.gemm_pushes(layout.local_experts, layout.world) \
            else None
        first_scatter = knobs.first_gemm_push(num_chunks)
        if not knobs.overlap:  # every pull before the first GEMM
            streams.wait(pulled[-1])
        # SMs that the transfer kernel's programs hold beside the GEMMs, which torch._grouped_mm leaves out
        carve = programs if kernel and transfer and knobs.overlap and knobs.gemm_carveout and streams.cuda else 0
        gemm_pushes_from = first_scatter if scatter is not None else num_chunks

        def carved(c):  # around chunk c's GEMMs (c = num_chunks: the work after the last chunk's)
            if not carve:
                return contextlib.nullcontext()
            return _sm_carveout(carve * _transfers_beside(c, num_chunks, gemm_pushes_from), device)

        results = []
        for c in range(num_chunks):
            _, _, lo, hi = layout.chunks[c]
            streams.wait(pulled[c])
            if staged[c]:  # the stage, ordered by source, into the receive order
                torch.index_select(stage[c % ahead][:hi - lo], 0, perm[lo:hi], out=recv[lo:hi])
                freed[c % ahead] = streams.record()
            with carved(c):
                result = compute(c, scatter if c >= first_scatter else None)
            if result is not None:
                if staged[c]:  # the results, in the receive order, into the stage order of the sources' blocks
                    result = torch.index_select(result, 0, inv[lo:hi])
                results.append((c, result, streams.record()))
            if knobs.overlap or c == num_chunks - 1:  # without overlap: every GEMM before the first push
                for done in results:
                    push(*done)
                results = []
            if c + ahead < num_chunks:
                pull(c + ahead)
        if after is not None:
            with carved(num_chunks):
                after()
        streams.join()
        pushed.clear()
        win_out.barrier()
    return run


def _segment_copies(segments, local, peers, push: bool) -> None:
    """Every (source, row in its buffer, row in ``local``, rows) segment, pulled from peers[source] into local
    or pushed the other way, by one torch._foreach_copy_."""
    pairs = [(peers[s][peer_row:peer_row + n], local[row:row + n]) if push else
             (local[row:row + n], peers[s][peer_row:peer_row + n])
             for s, peer_row, row, n in segments]
    if pairs:
        dsts, srcs = zip(*pairs)
        torch._foreach_copy_(list(dsts), list(srcs))


def _transfers_beside(c: int, chunks: int, first_scatter: int) -> int:
    """How many of the transfer kernel's launches run beside chunk c's GEMMs in an overlapped phase of ``chunks``
    chunks (c = chunks: the work after the last chunk's), where the chunks from ``first_scatter`` on store their
    results into the peers in their GEMMs: the next chunk's pull (issued before the GEMMs; the first pull goes alone)
    and the previous chunk's push, unless its GEMM stored the rows itself."""
    return int(c + 1 < chunks) + int(0 < c <= chunks and c - 1 < first_scatter)


@contextlib.contextmanager
def _sm_carveout(sms: int, device):
    """Within it, torch._grouped_mm leaves ``sms`` more of the device's SMs out (torch's experimental SM carve-out,
    which its CUTLASS grouped GEMM reads at launch); 0: nothing changes. At most half the SMs are left out: the
    transfer kernel's launches beside a GEMM may ask for more programs than there are SMs, and CUTLASS refuses a
    grid of too few (a candidate of 4 chunks and 96 programs failed in the EP tuner with every SM but one left out)."""
    if sms <= 0 or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(max(before or 0, min((before or 0) + sms, _sm_count(device) // 2)))
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 1
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNTS:
        _SM_COUNTS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNTS[key]


_SM_COUNTS: dict = {}


LOOKAHEAD = 2  # chunks whose pulls are issued ahead of the GEMMs
CHUNKS_COPY_ENGINE = 4  # OverlapConfig.chunks=None where the copy engines move the rows
CHUNKS_SM = 2  # OverlapConfig.chunks=None where the SMs move them
COPY_PROGRAMS_PER_PEER = 8  # OverlapConfig.copy_programs=None: the transfer kernel's programs per peer rank
COPY_ENGINE_SEGMENTS = 8  # OverlapConfig.copy_engine=None: copy engines up to this many (expert, source) pairs a chunk


class _Chunks:
    """The grouped GEMMs of one rank's local experts, chunk by chunk (the single-GPU MegaKernel's launches
    over a chunk's rows and experts). A GEMM whose output is the chunk's own (the down projection, the
    activation and input gradients, the weight gradients after every chunk) runs as torch._grouped_mm where
    the tile config asks, as in the single-GPU op (same bits: config.py), or as one cuBLAS matmul per expert
    (per_expert_mm, with the row bounds from the host's layout); the up projection writes the saved
    [rows, up_width] buffer and the activation in its epilogue, by Triton (or per_expert_mm)."""

    def __init__(self, layout: _Layout, offsets: torch.Tensor, w_up, w_down, b_up, b_down, spec, probe: torch.Tensor,
                 skip_gemms: bool = False, config_shape: tuple | None = None):
        from .kernels import config as config_mod
        from .kernels import reference

        self.layout, self.spec, self.skip_gemms = layout, spec, skip_gemms
        self.w_up, self.w_down, self.b_up, self.b_down = w_up, w_down, b_up, b_down
        self.up_width = reference.effective_weight(w_up, spec.up_layout).shape[2]  # [E, H, up_width]
        self.inter = reference.effective_weight(w_down, spec.down_layout).shape[1]  # [E, I, H]
        # the config of the single-GPU op over every rank's rows and all E experts (config_shape: the (rows,
        # experts) of another op whose tiles to take): same tiles, same bits
        rows, experts = config_shape or (layout.total_rows, w_up.shape[0] * layout.world)
        self.config = config_mod.current_config(rows, experts, probe.shape[1], self.inter, probe.device.type != "cuda",
                                                dtype=probe.dtype, device=probe.device)
        self.offsets = offsets  # _Layout.to_device
        self._layers = {}  # layer()'s, per chunk

    def layer(self, c: int, probe):
        """(the single-GPU op's Layer over chunk c's rows and experts, their offsets, rows and experts), made once:
        the forward's serve the backward (the forward's probe is of the rows' dtype and device, as the backward's)."""
        from .kernels import megakernel

        if c not in self._layers:
            e0, e1, lo, hi = self.layout.chunks[c]
            layer = megakernel.Layer(probe, (hi - lo, 1), self.w_up[e0:e1], self.w_down[e0:e1], self.spec,
                                     self.config)
            offs = self.offsets[e0:e1]
            # the per_expert_mm GEMMs' row bounds from the host's layout (no host synchronization)
            layer.set_host_bounds(offs, self.layout.chunk_ends(c))
            self._layers[c] = layer, offs, slice(lo, hi), slice(e0, e1)
        return self._layers[c]

    def forward(self, c, x, up, act, scatter=None):
        """up/act rows of chunk c from its received x rows (into the buffers' chunk rows); returns the chunk's
        down projection ([chunk rows, H]), None for a chunk without rows. With ``scatter`` (the layout's
        destinations, the peers' buffers) the down projection goes straight to the peers instead (None)."""
        from .kernels import megakernel
        from .kernels.triton_gemm import GLU_FWD, STORE

        layer, offs, rows, experts = self.layer(c, x)
        if rows.stop == rows.start:
            return None
        if self.skip_gemms:
            return x[rows]
        cfg = layer.config
        b_up = self.b_up[experts] if self.b_up is not None else None
        b_down = self.b_down[experts] if self.b_down is not None else None
        megakernel.rows_gemm(layer, cfg.up, a=x[rows], gather=False, row_order=offs, b=layer.up_eff, n=layer.inter,
                             k=layer.hidden_size, epilogue=GLU_FWD, c=up[rows], d=act[rows], bias=b_up, offsets=offs,
                             two_halves=layer.gated, col_mult=layer.col_mult if layer.gated else 1,
                             up_shift=layer.up_shift)
        return megakernel.rows_gemm(layer, cfg.down, a=act[rows], gather=False, row_order=offs, b=layer.down_eff,
                                    n=layer.hidden_size, k=layer.inter, epilogue=STORE, bias=b_down, offsets=offs,
                                    scatter=_chunk_scatter(scatter, rows))

    def backward(self, c, x, up, dy, act, d_up, grads, weight_grads: bool = True, scatter=None):
        """Chunk c's input-gradient rows ([chunk rows, H], returned; None for a chunk without rows; with
        ``scatter`` stored straight into the peers' buffers, as in forward), the activation and d_up into the
        chunk's rows of ``act`` and ``d_up``, and, with ``weight_grads``, its experts' weight and bias gradients
        (into grads; else weight_grads does them)."""
        from .kernels import megakernel
        from .kernels.triton_gemm import STORE

        layer, offs, rows, experts = self.layer(c, x)
        if rows.stop == rows.start:  # no rows: the chunk's experts' gradients are zero
            if weight_grads:
                _zero(grads, experts)
            return None
        if self.skip_gemms:
            return dy[rows]
        cfg = layer.config
        d_act = megakernel.rows_gemm(layer, cfg.grad_act, a=dy[rows], gather=False, row_order=offs,
                                     b=layer.down_eff.transpose(1, 2), n=layer.inter, k=layer.hidden_size,
                                     epilogue=STORE, offsets=offs)
        megakernel.act_backward(layer, d_act=d_act, up=up[rows], d_up=d_up[rows], act=act[rows], offsets=offs,
                                two_halves=layer.gated, col_mult=layer.col_mult if layer.gated else 1,
                                up_shift=layer.up_shift)
        del d_act
        d_x = megakernel.rows_gemm(layer, cfg.grad_input, a=d_up[rows], gather=False, row_order=offs,
                                   b=layer.up_eff.transpose(1, 2), n=layer.hidden_size, k=layer.up_width,
                                   epilogue=STORE, offsets=offs,
                                   scatter=_chunk_scatter(scatter, rows))
        if weight_grads:
            self._weight_grads(layer, offs, rows, experts, x, dy, act, d_up, grads)
        return d_x

    def weight_grads(self, x, dy, act, d_up, grads):
        """Every local expert's weight and bias gradients in one grouped GEMM each, after every chunk's
        backward (which left the activation in ``act`` and its gradient in ``d_up``). The weight gradients
        are new tensors, put in grads[0] and grads[1] (_new_grads left None there); the bias gradients go
        into their buffers."""
        from .kernels import megakernel

        if self.skip_gemms:
            grads[0], grads[1] = torch.empty_like(self.w_up), torch.empty_like(self.w_down)
            return
        rows, experts = slice(0, self.layout.rows), slice(0, self.w_up.shape[0])
        if self.layout.rows == 0:
            grads[0], grads[1] = torch.zeros_like(self.w_up), torch.zeros_like(self.w_down)
            _zero(grads[2:])  # the bias gradients' buffers
            return
        layer = megakernel.Layer(x, (self.layout.rows, 1), self.w_up, self.w_down, self.spec, self.config)
        ends = self.layout.ends(x.device)
        layer.set_host_bounds(ends, self.layout.expert_end)
        self._weight_grads(layer, ends, rows, experts, x, dy, act, d_up, grads)

    def _weight_grads(self, layer, offs, rows, experts, x, dy, act, d_up, grads):
        """The weight and bias gradients of the given experts over the given rows: into grads[0] and grads[1]'s
        experts, or, where those are None, as new tensors put there (by torch._grouped_mm where the config asks)."""
        from .kernels import megakernel

        d_w_up, d_w_down, d_b_up, d_b_down = grads
        cfg = layer.config
        down_dims = (1, 2) if self.spec.down_layout == "io" else (2, 1)
        up_dims = (1, 2) if self.spec.up_layout == "io" else (2, 1)
        d_w_down = megakernel.weight_grad(
            layer, cfg.wgrad_down, p=act[rows], p_gather=False, q=dy[rows], q_gather=False, q_scale=False,
            row_order=offs, w=None, offsets=offs,
            grad=d_w_down[experts] if d_w_down is not None else self.w_down.shape, m_dim=down_dims[0],
            n_dim=down_dims[1], bias_grad=d_b_down[experts] if d_b_down is not None else None)
        if grads[1] is None:
            grads[1] = d_w_down
        d_w_up = megakernel.weight_grad(
            layer, cfg.wgrad_up, p=x[rows], p_gather=False, q=d_up[rows], q_gather=False, q_scale=False,
            row_order=offs, w=None, offsets=offs, grad=d_w_up[experts] if d_w_up is not None else self.w_up.shape,
            m_dim=up_dims[0], n_dim=up_dims[1], bias_grad=d_b_up[experts] if d_b_up is not None else None)
        if grads[0] is None:
            grads[0] = d_w_up


def _chunk_scatter(scatter, rows: slice):
    """A chunk's part of _exchange's ``scatter`` (the destinations of its rows, the peers' buffers), or None."""
    return (scatter[0][rows], scatter[1]) if scatter is not None else None


def _new_grads(w_up, w_down, b_up, b_down, weights: bool = True):
    """[d_w_up, d_w_down, d_b_up, d_b_down]: buffers the chunks write their experts' part of (None for a missing
    bias). With weights=False the weight gradients' entries are None: _Chunks.weight_grads makes them."""
    return [torch.empty_like(w_up) if weights else None, torch.empty_like(w_down) if weights else None,
            torch.empty_like(b_up) if b_up is not None else None,
            torch.empty_like(b_down) if b_down is not None else None]


def _zero(grads, experts=slice(None)):
    """Zero the given experts' rows of each gradient (None stays None); returns the list."""
    for g in grads:
        if g is not None:
            g[experts].zero_()
    return grads


def _plan(ids, num_experts: int, spec):
    from .kernels.triton_routing import routing_plan

    return routing_plan(ids, num_experts, clamp=spec.out_of_range == "clamp")


def _table(offsets: torch.Tensor, num_tokens: int, group, beside=None):
    """All ranks' per-expert counts and token counts, on the host: one all-gather and one copy to the host, the
    layer's one synchronization. beside() (work of the current stream) is issued after that copy and before the
    host waits for it: the GPU runs it while the host lays out the step. No other host copy or synchronization:
    a host tensor copied to the device would wait for the stream's earlier work first."""
    experts = offsets.numel()
    mine = offsets.new_empty(experts + 1)
    if experts:
        mine[:1].copy_(offsets[:1])
        torch.sub(offsets[1:], offsets[:-1], out=mine[1:experts])
    mine[experts:].fill_(num_tokens)
    world = dist.get_world_size(group)
    every = offsets.new_empty(world * (experts + 1))  # flat: gloo takes no [W, n] output
    dist.all_gather_into_tensor(every, mine, group=group)
    every = every.view(world, experts + 1)
    copied = None
    if every.is_cuda:
        host = torch.empty(every.shape, dtype=every.dtype, pin_memory=True)
        host.copy_(every, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    else:
        host = every
    if beside is not None:
        beside()
    if copied is not None:
        copied.synchronize()
    table = host.tolist()
    return [row[:-1] for row in table], [row[-1] for row in table], every


def _forward_phase(layout: _Layout, table, group, knobs: OverlapConfig, x, out_dtype, fill, setup):
    """The forward's transfers and GEMMs: fill(window) writes this rank's rows into the window's ``send`` and
    returns True, and the peers wait for them in a barrier (or returns False: the rows and that barrier went
    before, every rank's alike), then every chunk is pulled into ``x``, runs its up and down GEMMs and is pushed
    back. setup() -> (the _Chunks, the [rows, up_width] buffer that keeps the up
    projection) runs once the first pulls are issued (_start_exchange). Returns the window whose ``back`` holds
    this rank's result rows ([*, H] of out_dtype, in its send order), the chunks and the up projection."""
    size, device = x.shape[1], x.device
    win_x = _window(group, layout.capacity, size, x.dtype, device)
    win_y = _window(group, layout.capacity, size, out_dtype, device)
    if fill(win_x):
        win_x.barrier()
    run = _start_exchange(layout, table, win_x, win_y, x, knobs, device)
    chunks, up = setup()
    act = torch.empty(layout.rows, chunks.inter, dtype=chunks.w_down.dtype, device=device)
    run(lambda c, scatter: chunks.forward(c, x, up, act, scatter))
    return win_y, chunks, up


def _backward_phase(layout: _Layout, table, chunks: _Chunks, group, knobs: OverlapConfig, x, up, dy_dtype, fill,
                    beside=None):
    """The backward's transfers and GEMMs: fill(window) writes this rank's output-gradient rows into the
    window's ``send``; every chunk's rows are pulled, run the input- and weight-gradient GEMMs and the
    input-gradient rows are pushed back. beside() (work of the current stream that reads no row of the phase)
    runs once the first pulls are issued, beside them. Returns the window whose ``back`` holds this rank's
    input-gradient rows, in its send order, [d_w_up, d_w_down, d_b_up, d_b_down] (None for a missing bias) and
    what beside returned (None without it)."""
    size, device = x.shape[1], x.device
    win_dy = _window(group, layout.capacity, size, dy_dtype, device)
    win_dx = _window(group, layout.capacity, size, chunks.w_up.dtype, device)
    fill(win_dy)
    win_dy.barrier()
    dy = _receive_buffer("dy", layout.rows, size, dy_dtype, device, knobs)
    run = _start_exchange(layout, table, win_dy, win_dx, dy, knobs, device)
    extra = beside() if beside is not None else None
    act = torch.empty(layout.rows, chunks.inter, dtype=chunks.w_down.dtype, device=device)
    d_up = torch.empty_like(up)
    last = knobs.weight_grads_last
    grads = _new_grads(chunks.w_up, chunks.w_down, chunks.b_up, chunks.b_down, weights=not last)
    run(lambda c, scatter: chunks.backward(c, x, up, dy, act, d_up, grads=grads, weight_grads=not last,
                                           scatter=scatter),
        after=(lambda: chunks.weight_grads(x, dy, act, d_up, grads)) if last else None)
    return win_dx, grads, extra


class _OverlapEP(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weights, w_up, w_down, b_up, b_down, ids, spec, group, knobs):
        from .kernels.triton_routing import combine, gather_rows

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local_experts = w_up.shape[0]
        num_experts = local_experts * world
        num_tokens, top_k = ids.shape
        device = hidden.device
        row_order, slot_row, offsets = _plan(ids, num_experts, spec)
        size = hidden.shape[1]
        slots = num_tokens * top_k
        # the rows go into this rank's ``send`` while the host waits for the count table and lays out the step,
        # when the cached window takes them (no peer reads it since the last phase's closing barrier), and the
        # barrier that tells the peers so is passed there too. Every rank has the same cached windows (they are made
        # together), so all of them take that barrier or none; if some rank's rows do not fit, the window is
        # replaced on every rank (_window, from the all-gathered table) and _forward_phase fills the new one.
        early = _WINDOWS.get(_window_key(group, hidden.dtype, size, device))

        def beside():
            if 0 < slots <= early.capacity:
                gather_rows(hidden, row_order, top_k, out=early.send(rank)[:slots])
            early.barrier()
        counts, tokens, every = _table(offsets, num_tokens, group, beside=None if early is None else beside)
        chunk, block, engine, batched = knobs.layout_knobs(local_experts, world)
        layout = _Layout(counts, tokens, top_k, rank, world, local_experts, chunk, size, block, engine, batched,
                         device_counts=every)
        offsets_dev, table = layout.to_device(device)
        ctx.layout, ctx.table, ctx.spec, ctx.group, ctx.knobs = layout, table, spec, group, knobs
        ctx.shape = (num_tokens, top_k)

        def setup():  # the GEMMs' set-up, which the first pulls do not wait for (_forward_phase)
            chunks = _Chunks(layout, offsets_dev, w_up, w_down, b_up, b_down, spec, hidden,
                             skip_gemms=knobs.timing == "comm")
            return chunks, torch.empty(layout.rows, chunks.up_width, dtype=w_up.dtype, device=device)
        if layout.capacity == 0:  # no rank has a token
            ctx.chunks = setup()[0]
            ctx.save_for_backward(hidden, weights, row_order, slot_row, offsets, None, None, None)
            return hidden.new_zeros(num_tokens, size, dtype=spec.out_dtype)
        x = _receive_buffer("x", layout.rows, size, hidden.dtype, device, knobs)

        def fill(win):  # not the window found above (none, or one too small for some rank): the rows, the barrier
            if win is early:
                return False
            if slots:
                gather_rows(hidden, row_order, top_k, out=win.send(rank)[:slots])
            return True
        win_y, ctx.chunks, up = _forward_phase(layout, table, group, knobs, x, w_down.dtype, fill, setup)
        rows = win_y.back(rank)[:slots]
        # the routing weights' gradient reads the result rows (y): a copy of them, since the window's ``back`` is
        # reused by the next call. On CUDA the copy runs beside the work after the combine (_copy_back;
        # OverlapConfig.copy_back_beside), else the combine copies the rows it reads.
        y, ctx.y_ready = None, None
        if ctx.needs_input_grad[1]:
            y = torch.empty(layout.send_start[rank][-1], size, dtype=rows.dtype, device=device)
        side = y is not None and device.type == "cuda" and knobs.copy_back_beside
        out = combine(rows, slot_row, weights.reshape(num_tokens, top_k), offsets, num_tokens, top_k, spec.out_dtype,
                      copy=None if side else y)
        if side:
            ctx.y_ready = _copy_back(rows, y)
        ctx.save_for_backward(hidden, weights, row_order, slot_row, offsets, x, up, y)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from .kernels.triton_routing import combine, gather_rows, routing_weight_grad

        hidden, weights, row_order, slot_row, offsets, x, up, y = ctx.saved_tensors
        layout, chunks, group, knobs = ctx.layout, ctx.chunks, ctx.group, ctx.knobs
        w_up, w_down, b_up, b_down = chunks.w_up, chunks.w_down, chunks.b_up, chunks.b_down
        num_tokens, top_k = ctx.shape
        if layout.capacity == 0:
            grads = _zero(_new_grads(w_up, w_down, b_up, b_down))
            return (torch.zeros_like(hidden), torch.zeros_like(weights), *grads, None, None, None, None)
        rank = layout.rank
        slots = num_tokens * top_k
        grad_out = grad_out.contiguous()
        # the routing weights' gradient reads no row of the phase: beside its first pulls
        def weight_grad():
            if ctx.y_ready is not None:
                torch.cuda.current_stream(y.device).wait_event(ctx.y_ready)
            return routing_weight_grad(grad_out, y, slot_row, offsets, num_tokens, top_k, weights.dtype)
        win_dx, grads, d_weights = _backward_phase(
            layout, ctx.table, chunks, group, knobs, x, up, grad_out.dtype,
            lambda win: gather_rows(grad_out, row_order, top_k, weights.reshape(-1).contiguous(),
                                    out=win.send(rank)[:slots]),
            beside=None if y is None else weight_grad)
        d_hidden = combine(win_dx.back(rank)[:slots], slot_row, None, offsets, num_tokens, top_k, hidden.dtype)
        return (d_hidden, d_weights, *grads, None, None, None, None)


def ep_experts_overlapped(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec: str, group=None,
                          knobs: OverlapConfig | None = None):
    """The EP experts layer of ep.ep_experts (same arguments and result), with its transfers overlapped
    with the GEMMs through symmetric memory. It runs the MegaKernel's Triton kernels (on CPU only in the
    interpreter, with UNIEP_KERNELS=triton); a call they do not take (a dtype, a gate, the CPU path) runs the
    sequential ep.ep_experts instead, with one log line on CUDA."""
    from .ep import ep_experts
    from .kernels import megakernel

    group = group if group is not None else dist.group.WORLD
    s = decode_spec(spec)
    if s.post is not None:
        raise ValueError("uniep: expert parallelism does not take post-expert programs yet")
    if w_up.shape[0] == 0:
        raise ValueError("uniep: every rank needs at least one expert")
    reason = megakernel.unsupported_reason(hidden, topk_ids, w_up, w_down, b_up, b_down, [], s)
    if reason is not None:
        if hidden.is_cuda:
            megakernel.warn_once("ep_overlap", reason, "uniep: the overlapped EP layer runs the sequential one "
                                 "instead: %s")
        return ep_experts(hidden, topk_ids, topk_weights, w_up, w_down, b_up, b_down, spec, group)
    return _OverlapEP.apply(hidden, topk_weights, w_up, w_down, b_up, b_down, topk_ids, s, group,
                            knobs if knobs is not None else _default_knobs(hidden, topk_ids, w_up, w_down, s, group))


def _default_knobs(hidden, topk_ids, w_up, w_down, spec, group) -> OverlapConfig:
    """The tuned knobs of this shape and EP size from the tuning cache (written by uniep/tuner.py's tune_ep), else the
    defaults. Ranks may pick differently (uneven token counts fall in other row buckets): the knobs only
    schedule each rank's own transfers and GEMMs, between the same collectives and barriers."""
    return _cached_knobs(hidden, topk_ids.numel(), w_up, w_down, spec, group)


def _cached_knobs(probe, rows: int, w_up, w_down, spec, group) -> OverlapConfig:
    """_default_knobs for a rank that routes ``rows`` rows of ``probe``'s dtype, width and device."""
    if probe.device.type != "cuda":
        return OverlapConfig()
    from . import tuning_cache

    key = ep_rows_key(probe.dtype, rows, probe.shape[1], w_up, w_down, spec, dist.get_world_size(group))
    return cached_ep_config(tuning_cache.gpu_name(probe.device), key) or OverlapConfig()


def ep_rows_key(dtype, rows: int, hidden: int, w_up, w_down, spec, world: int) -> str:
    """The tuning cache's key of one rank's EP layer from the rows it routes (T * K; what the compiled exchange
    sends): its routed rows times the EP size, all experts, H, I, EP size."""
    from . import tuning_cache
    from .kernels import reference

    spec = decode_spec(spec) if isinstance(spec, str) else spec
    inter = reference.effective_weight(w_down, spec.down_layout).shape[1]
    return tuning_cache.shape_key(dtype, rows * world, w_up.shape[0] * world, hidden, inter, ep_size=world)


def ep_config_to_dict(cfg) -> dict:
    """The tuning cache's entry of an OverlapConfig."""
    return {"ep_overlap": dataclasses.asdict(cfg)}


def cached_ep_config(gpu_name: str, key: str):
    """The tuned OverlapConfig for ``key`` (an ep_size > 1 shape_key) from the tuning cache, or None."""
    from . import tuning_cache

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


# ---- the token all-to-all, the local experts and the all-to-all back, as one overlapped call ------------------
#
# What the compile rewrite of a plain EP layer's second graph runs (ep.py's uniep::ep_exchange, patterns/ep.py's
# exchange match): the rows arrive in the sender's order (the dispatch graph sorted them), with the split sizes
# the host read and the per-(source, local expert) counts of the count exchange. The same windows, chunks and
# transfers as above; only the layout comes from those sizes instead of an all-gathered routing table.

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


def _exchange_unsupported(send, recv_counts, w_up, w_down, b_up, b_down, spec) -> str | None:
    """None if this rank can run the overlapped exchange, else why the sequential steps run."""
    from .kernels import megakernel

    reason = megakernel.unsupported_reason(send, recv_counts, w_up, w_down, b_up, b_down, [], spec)
    if reason is None and spec.out_dtype != send.dtype:
        reason = f"the experts' output is {spec.out_dtype} and their input {send.dtype}"
    if reason is None and recv_counts.dtype != torch.int64:
        reason = f"the received counts are {recv_counts.dtype}"
    return reason


# ---- the count table from the dispatch ------------------------------------------------------------------------
#
# uniep.ep_dispatch(gather_counts=True) all-gathers every rank's per-expert counts and starts copying the [W, E]
# table to the host; the model's own .tolist() of the split sizes (its one synchronization) then waits for that
# copy too. The exchange of the next graph takes the table by its received counts: the dispatch returned that
# tensor, and the entry holds it, so its memory cannot belong to another tensor while the entry lives. So the
# exchange lays out its transfers without a collective and a synchronization of its own. Every rank runs the
# same graphs, so every rank finds its table or none does; one that finds none all-gathers its claims.

_COUNT_TABLES: dict = {}  # (device, address of the received counts) -> (received counts, host table, copy event)
MAX_COUNT_TABLES = 8  # tables of dispatches no exchange read (an exchange left unfused, say) are dropped
COUNT_TABLE_PATHS = {"dispatch": 0, "gathered": 0}  # where the exchanges' count tables came from (tests read it)


def stash_count_table(recv: torch.Tensor, table: torch.Tensor) -> None:
    """Keep the all-gathered [W, E] count ``table`` for the exchange that receives ``recv`` (the dispatch's
    received counts, a slice of it): a copy to pinned host memory on the current stream, read after the
    model's synchronization."""
    from .ep import _address_key

    key = _address_key(recv)
    if key is None:
        return
    if table.is_cuda:
        host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        host.copy_(table, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host, event = table, None
    _COUNT_TABLES.pop(key, None)
    _COUNT_TABLES[key] = (recv, host, event)
    while len(_COUNT_TABLES) > MAX_COUNT_TABLES:
        _COUNT_TABLES.pop(next(iter(_COUNT_TABLES)))


def _take_count_table(recv_counts: torch.Tensor):
    """The dispatch's [W, E] count table (host lists) for these received counts, or None; taken once."""
    from .ep import _address_key

    entry = _COUNT_TABLES.pop(_address_key(recv_counts), None)
    if entry is None:
        return None
    recv, host, event = entry
    if recv.shape != recv_counts.shape or recv.dtype != recv_counts.dtype:
        return None
    if event is not None:
        event.synchronize()  # done already: the model's .tolist() after the copy waited for the stream
    return host.tolist()


def _table_from_counts(table, rank: int, local_experts: int, ok: bool, send_sizes, recv_sizes,
                       sent: int) -> torch.Tensor:
    """The exchange's host table (_exchange_host's layout) from the dispatch's count table: every rank's send
    sizes (per owner, the sums of its counts), ``ok`` for every rank (the path decision reads only dtypes, the
    spec and the expert count, which SPMD ranks share), the claims the sizes imply, and this rank's received
    counts. This rank's own split sizes must be the table's: they came from the same dispatch (``sent``: the rows
    it sends, which _check_exchange holds against them)."""
    world = len(table)
    sizes = [[sum(row[r * local_experts:(r + 1) * local_experts]) for r in range(world)] for row in table]
    if sizes[rank] != list(send_sizes) or [sizes[s][rank] for s in range(world)] != list(recv_sizes):
        raise ValueError(f"uniep.ep_exchange: split sizes {list(send_sizes)} / {list(recv_sizes)} on rank {rank} "
                         f"disagree with the dispatch's count table (send sizes per rank {sizes})")
    mine = slice(rank * local_experts, (rank + 1) * local_experts)
    host = [sizes[s] + [int(ok)] + [sizes[q][s] for q in range(world)] + [sent if s == rank else sum(sizes[s])]
            + [sizes[q][s] for q in range(world)] + table[s][mine] for s in range(world)]
    return torch.tensor(host, dtype=torch.int64)


def _exchange_claims(send, recv_counts, send_sizes, recv_sizes, ok: bool) -> torch.Tensor:
    """What a rank all-gathers, [3W + 2] on the device: its send sizes, whether it takes the overlapped path, and
    for the ranks' common size check its receive sizes, its rows, and the per-source sums of its received
    counts."""
    host = torch.tensor(list(send_sizes) + [int(ok)] + list(recv_sizes) + [send.shape[0]], dtype=torch.int64,
                        pin_memory=send.is_cuda)  # pinned: the copy does not wait for the stream's earlier work
    return torch.cat([host.to(send.device, non_blocking=True), recv_counts.sum(1).to(torch.int64)])


def _exchange_host(table: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    """The all-gathered [W, 3W + 2] claims beside this rank's received counts, [W, 3W + 2 + E_local], on the
    host: one device-to-host copy, the exchange's one synchronization. The backward reads it again from the
    host, without another."""
    return torch.cat([table, recv_counts.to(table.dtype)], dim=1).cpu()


def _split_host(host: torch.Tensor):
    """(rows [s] = send sizes of rank s to each rank, then its flag; counts [s] = rows from s per local expert;
    claims [s] = rank s's receive sizes, its rows, and the sums of its received counts per source)."""
    world = host.shape[0]
    flat = host.tolist()
    return ([row[:world + 1] for row in flat], [row[3 * world + 2:] for row in flat],
            [row[world + 1:3 * world + 2] for row in flat])


_EXCHANGE_LAYOUTS: dict = {}


def _exchange_layout(rows, counts, rank: int, local_experts: int, knobs: OverlapConfig, width: int) -> _Layout:
    """The _Layout of an exchange: source s's rows for rank r start after its rows for the ranks before r (the
    split sizes), and within this rank's block they run expert by expert (the received counts). The last few
    are cached by their host integers: a backward (and, with steady routing, the next step) reuses them."""
    key = (tuple(map(tuple, rows)), tuple(map(tuple, counts)), rank, local_experts, width,
           *knobs.layout_knobs(local_experts, len(rows)))
    layout = _EXCHANGE_LAYOUTS.get(key)
    if layout is None:
        layout = _EXCHANGE_LAYOUTS[key] = _build_exchange_layout(rows, counts, rank, local_experts, knobs, width)
        while len(_EXCHANGE_LAYOUTS) > 8:
            _EXCHANGE_LAYOUTS.pop(next(iter(_EXCHANGE_LAYOUTS)))
    return layout


def _build_exchange_layout(rows, counts, rank: int, local_experts: int, knobs: OverlapConfig, width: int) -> _Layout:
    world = len(rows)
    per_expert = []
    for s in range(world):
        row = []
        for r in range(world):
            row.extend(counts[s] if r == rank else [rows[s][r]] + [0] * (local_experts - 1))
        per_expert.append(row)
    chunk, block, engine, batched = knobs.layout_knobs(local_experts, world)
    return _Layout(per_expert, [sum(rows[s][:world]) for s in range(world)], 1, rank, world, local_experts, chunk,
                   width, block, engine, batched)


def _check_exchange(rows, claims):
    """Every rank checks every rank's split sizes on the same all-gathered table, so that all of them raise the
    same error together (one rank raising alone would leave the others waiting in a collective)."""
    world = len(rows)
    problems = []
    for r in range(world):
        recv_sizes, sent, sums = claims[r][:world], claims[r][world], claims[r][world + 1:]
        if sum(rows[r][:world]) != sent:
            problems.append(f"rank {r}: send sizes {rows[r][:world]} for {sent} rows")
        got = [rows[s][r] for s in range(world)]
        if got != recv_sizes:
            problems.append(f"rank {r}: receive sizes {recv_sizes}, but the sources send {got}")
        if sums != recv_sizes:
            problems.append(f"rank {r}: received per-expert counts that sum to {sums} per source, receive sizes "
                            f"{recv_sizes}")
    if problems:
        raise ValueError("uniep.ep_exchange: inconsistent split sizes: " + "; ".join(problems))


def _all_to_all(t, out_splits, in_splits, group):
    out = t.new_empty(sum(out_splits), *t.shape[1:])
    dist.all_to_all_single(out, t.contiguous(), list(out_splits), list(in_splits), group=group)
    return out


def _local_ids(recv_counts, rows: int):
    world, local_experts = recv_counts.shape
    ids = torch.arange(local_experts, device=recv_counts.device).repeat(world)
    return ids.repeat_interleave(recv_counts.reshape(-1), output_size=rows).unsqueeze(-1)


def _sequential_experts(x, recv_counts, w_up, w_down, b_up, b_down, spec: str):
    """(ids, weights, the experts op's outputs) over the received rows, as the replaced graph ran it."""
    ids = _local_ids(recv_counts, x.shape[0])
    ones = torch.ones_like(ids, dtype=x.dtype)
    return ids, ones, torch.ops.uniep.moe_experts(x, ids, ones, w_up, w_down, b_up, b_down, [], spec)


def exchange_forward(send, recv_counts, w_up, w_down, b_up, b_down, spec: str, group, send_sizes, recv_sizes,
                     knobs: OverlapConfig | None = None):
    """back rows [S, H] (the experts' rows returned to this rank, in its send order), and for the backward: the
    received rows and the up projection (the overlapped path's, in its layout), and on the host the
    [W, 3W + 2 + E_local] table of every rank's send sizes, whether it takes the overlapped path, what its size
    check reads (_exchange_claims), and the rows this rank receives from it per local expert.

    Every rank all-gathers its send sizes with that flag; the overlapped path runs only where every rank takes
    it (the ranks meet in its barriers), else the sequential steps the rewrite replaced: the all-to-all, the
    experts op on the received rows (local expert ids from the counts, weight 1), the all-to-all back."""
    from .kernels import megakernel
    from .kernels import reference

    s = decode_spec(spec)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local_experts, size, device = w_up.shape[0], send.shape[1], send.device
    received = sum(recv_sizes)
    up_width = reference.effective_weight(w_up, s.up_layout).shape[2]
    reason = _exchange_unsupported(send, recv_counts, w_up, w_down, b_up, b_down, s)
    gathered = _take_count_table(recv_counts)
    if gathered is not None:  # the dispatch's table: no collective, no synchronization here
        COUNT_TABLE_PATHS["dispatch"] += 1
        table = _table_from_counts(gathered, rank, local_experts, reason is None, send_sizes, recv_sizes,
                                   send.shape[0])
    else:
        COUNT_TABLE_PATHS["gathered"] += 1
        mine = _exchange_claims(send, recv_counts, send_sizes, recv_sizes, reason is None)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        table = _exchange_host(torch.stack(parts), recv_counts)
    rows, counts, claims = _split_host(table)
    _check_exchange(rows, claims)
    if not all(row[world] for row in rows):
        why = reason or "another rank cannot take it"
        if send.is_cuda:
            megakernel.warn_once("ep_exchange", why, "uniep: the overlapped EP exchange runs the sequential steps "
                                 "instead: %s")
        x = _all_to_all(send, recv_sizes, send_sizes, group)
        back = _all_to_all(_sequential_experts(x, recv_counts, w_up, w_down, b_up, b_down, spec)[2][0], send_sizes,
                           recv_sizes, group)
        return back, x, send.new_empty(received, up_width, dtype=w_up.dtype), table
    knobs = knobs or _cached_knobs(send, send.shape[0], w_up, w_down, s, group)
    layout = _exchange_layout(rows, counts, rank, local_experts, knobs, size)
    offsets, transfers = layout.to_device(device)
    x = _receive_buffer("x", layout.rows, size, send.dtype, device, knobs)

    def setup():  # the GEMMs' set-up, which the first pulls do not wait for (_forward_phase)
        chunks = _Chunks(layout, offsets, w_up, w_down, b_up, b_down, s, send,
                         config_shape=(layout.rows, local_experts))
        return chunks, torch.empty(layout.rows, up_width, dtype=w_up.dtype, device=device)
    if layout.capacity == 0:  # no rank sends a row
        return send.new_empty(0, size), x, setup()[1], table

    def fill(win):
        win.send(rank)[:send.shape[0]].copy_(send)
        return True
    win_y, _, up = _forward_phase(layout, transfers, group, knobs, x, w_down.dtype, fill, setup)
    return win_y.back(rank)[:send.shape[0]].clone(), x, up, table


def exchange_backward(grad_back, x, up, recv_counts, table, w_up, w_down, b_up, b_down, spec: str, group, send_sizes,
                      recv_sizes, knobs: OverlapConfig | None = None):
    """(d_send, d_w_up, d_w_down, d_b_up, d_b_down) of exchange_forward, on the path the forward took (the
    table says). The sequential path runs the experts op's forward again on the saved received rows, for what
    its backward op reads."""
    s = decode_spec(spec)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local_experts, size, device = w_up.shape[0], grad_back.shape[1], grad_back.device
    grad_back = grad_back.contiguous()
    rows, counts, _ = _split_host(table)
    if not all(row[world] for row in rows):
        # the experts op's forward again on the saved received rows, for the saved tensors its backward reads
        d_rows = _all_to_all(grad_back, recv_sizes, send_sizes, group)
        ids, ones, (_, row_order, slot_row, offsets, up_rows, down_rows) = _sequential_experts(
            x, recv_counts, w_up, w_down, b_up, b_down, spec)
        d_x, _, d_w_up, d_w_down, d_b_up, d_b_down, _ = torch.ops.uniep.moe_experts_backward(
            d_rows, x, ids, ones, w_up, w_down, b_up, b_down, [], row_order, slot_row, offsets, up_rows, down_rows,
            spec, False)
        return (_all_to_all(d_x, send_sizes, recv_sizes, group), d_w_up, d_w_down,
                d_b_up if b_up is not None else None, d_b_down if b_down is not None else None)
    knobs = knobs or _cached_knobs(grad_back, grad_back.shape[0], w_up, w_down, s, group)
    layout = _exchange_layout(rows, counts, rank, local_experts, knobs, size)
    offsets, transfers = layout.to_device(device)
    chunks = _Chunks(layout, offsets, w_up, w_down, b_up, b_down, s, grad_back,
                     config_shape=(layout.rows, local_experts))
    if layout.capacity == 0:
        return (grad_back.new_zeros(0, size), *_zero(_new_grads(w_up, w_down, b_up, b_down)))
    win_dx, grads, _ = _backward_phase(layout, transfers, chunks, group, knobs, x, up, grad_back.dtype,
                                       lambda win: win.send(rank)[:grad_back.shape[0]].copy_(grad_back))
    return (win_dx.back(rank)[:grad_back.shape[0]].clone(), *grads)
