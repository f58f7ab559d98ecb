"""Where every row of one overlapped EP call lives: the layout tables, from the all-gathered count table.

Where each row goes comes from the routing plan alone, never from arrival order:

    send        the source writes its rows in plan order, (global expert, token, k), into its ``send``
    receive     rank r lays out its local experts' rows expert-major, and within an expert by
                (source rank, token, k): the single-GPU op's order over all ranks' tokens
    chunks      the local experts are cut into chunks; a chunk holds every row of its experts, so its GEMMs are the
                single-GPU op's GEMMs over those experts, in the same row order

Layout holds these on the host and makes the device tables the transfers and GEMMs read (to_device: the GEMMs'
offsets, the transfer kernel's segment table, the scattering GEMMs' destinations, the copy engines' stage
permutations). exchange_layout makes (and caches) the layout of the compiled exchange from its split sizes.
"""
from __future__ import annotations

import array
import ctypes
import functools
import itertools

import torch

from .config import OverlapConfig, even_chunks


class Layout:
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
        sizes = chunk if isinstance(chunk, tuple) else even_chunks(local_experts, chunk)
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
        from ..kernels.triton_transfer import MAX_PEERS

        if self.engine or self.world > MAX_PEERS:
            return []
        at, world = self._at, self.world
        return [v for i, (p, n) in enumerate(zip(self._peer, self._mine))
                for v in (at[i], (p - at[i]) * 8 + i % world, n)]

    def _table(self) -> list:
        """The transfer kernel's table on the host, flat (kernels.segment_table), chunk after chunk."""
        from ..kernels.triton_transfer import segment_table

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
        from ..kernels.config import interpreting
        from ..kernels.triton_transfer import expand_runs

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
        from ..kernels.config import interpreting
        from ..kernels.triton_transfer import MAX_CHUNKS, MAX_PEERS, TABLE_COLUMNS, layout_tables

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


_EXCHANGE_LAYOUTS: dict = {}


def exchange_layout(rows, counts, rank: int, local_experts: int, knobs: OverlapConfig, width: int) -> Layout:
    """The Layout of an exchange: source s's rows for rank r start after its rows for the ranks before r (the
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


def _build_exchange_layout(rows, counts, rank: int, local_experts: int, knobs: OverlapConfig, width: int) -> Layout:
    world = len(rows)
    per_expert = []
    for s in range(world):
        row = []
        for r in range(world):
            row.extend(counts[s] if r == rank else [rows[s][r]] + [0] * (local_experts - 1))
        per_expert.append(row)
    chunk, block, engine, batched = knobs.layout_knobs(local_experts, world)
    return Layout(per_expert, [sum(rows[s][:world]) for s in range(world)], 1, rank, world, local_experts, chunk,
                  width, block, engine, batched)
