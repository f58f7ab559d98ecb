"""The overlapped EP layer's row layout (uniep_dynamo/ep/layout.py), without processes: the copy
engines' per-(chunk, source) copies into a stage plus the stage permutations must put every row where the
per-(expert, source) segments put it, and push every result row back to where those segments push it."""
import pytest
import torch

from uniep_dynamo.ep.layout import Layout


def _counts(world, local_experts, seed, hot=None, empty_source=None):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (world, world * local_experts), generator=g)
    if hot is not None:
        counts[:, hot] += 9
    if empty_source is not None:
        counts[empty_source] = 0
    return counts.tolist()


def _buffers(counts, width):
    """Each source's send buffer: rows whose values name (source, row)."""
    return [torch.arange(sum(row) * width, dtype=torch.float32).view(-1, width) + 1000 * s
            for s, row in enumerate(counts)]


def _segment_rows(layout, sends, width):
    """The receive buffer as the per-(expert, source) segments fill it (-1 where none does)."""
    recv = torch.full((layout.rows, width), -1.0)
    for c, (_, _, lo, _) in enumerate(layout.chunks):
        for s, peer_row, row, n in layout.segments[c]:
            recv[lo + row:lo + row + n] = sends[s][peer_row:peer_row + n]
    return recv


def _check_returned(layout, rank, local_experts, backs, sends, seed):
    """Every row this rank's experts received went back to where it came from in its source's buffer."""
    first = rank * local_experts
    for s in range(len(sends)):
        mine = slice(layout.send_start[s][first], layout.send_start[s][first + local_experts])
        assert torch.equal(backs[s][mine], sends[s][mine]), (seed, rank, s)


@pytest.mark.parametrize("world,local_experts,chunk,hot,empty_source", [
    (2, 4, 4, None, None),  # one chunk of four experts
    (4, 8, (2, 4, 2), 3, None),  # tapered chunks (OverlapConfig.taper)
    (4, 3, 2, None, None),  # uneven chunks
    (4, 8, 3, 5, None),  # a hot expert
    (3, 2, 1, None, None),  # chunks of one expert: the stage is the receive order
    (4, 4, 2, None, 2),  # a source that sends nothing
    (2, 4, 4, None, 0),
])
def test_copy_engine_stage_matches_the_segments(world, local_experts, chunk, hot, empty_source):
    width = 3
    for seed in range(3):
        counts = _counts(world, local_experts, seed, hot, empty_source)
        tokens = [sum(row) for row in counts]
        for rank in range(world):
            layout = Layout(counts, tokens, 1, rank, world, local_experts, chunk, width, None, engine=True)
            sends = _buffers(counts, width)
            recv = _segment_rows(layout, sends, width)  # where the per-(expert, source) segments put every row
            assert (recv >= 0).all()
            perm, inv = layout.permutations(torch.device("cpu"))
            got = torch.full_like(recv, -2.0)
            backs = [torch.full_like(b, -3.0) for b in sends]
            for c, (_, _, lo, hi) in enumerate(layout.chunks):
                stage = torch.full((hi - lo, width), -4.0)
                for s, peer_row, row, n in layout.blocks[c]:
                    stage[row:row + n] = sends[s][peer_row:peer_row + n]
                if layout.staged[c]:
                    torch.index_select(stage, 0, perm[lo:hi], out=got[lo:hi])
                    out = torch.index_select(got[lo:hi], 0, inv[lo:hi])
                else:
                    assert torch.equal(perm[lo:hi], torch.arange(hi - lo))
                    got[lo:hi] = stage
                    out = got[lo:hi]
                assert torch.equal(out, stage)  # the reverse gather restores the stage order
                for s, peer_row, row, n in layout.blocks[c]:  # the pushes of the results (here: the rows)
                    backs[s][peer_row:peer_row + n] = out[row:row + n]
            assert torch.equal(got, recv), (seed, rank)
            _check_returned(layout, rank, local_experts, backs, sends, seed)
            one_expert = chunk == 1 or empty_source is not None and world == 2
            sizes = chunk if isinstance(chunk, tuple) else None
            if sizes:
                assert [e1 - e0 for e0, e1, _, _ in layout.chunks] == list(sizes)
            if one_expert:
                assert not any(layout.staged)


@pytest.mark.parametrize("world,local_experts,chunk,lanes", [(2, 4, 4, 1), (4, 3, 2, 2), (4, 8, 3, 3), (3, 2, 1, 4)])
def test_batched_copies_are_the_segments_in_bytes(world, local_experts, chunk, lanes):
    """With batch_copies the layout stages nothing, and its batches are the (expert, source) segments in bytes: the
    pulls put every row where the segments do, the pushes put it back, and a source's runs stay on one stream."""
    width = 3
    for seed in range(3):
        counts = _counts(world, local_experts, seed, hot=1 if seed == 2 else None)
        tokens = [sum(row) for row in counts]
        for rank in range(world):
            layout = Layout(counts, tokens, 1, rank, world, local_experts, chunk, width, None, engine=True,
                            batched=True)
            assert not any(layout.staged) and not layout.blocks
            sends = _buffers(counts, width)
            recv = torch.full((layout.rows, width), -1.0)
            backs = [torch.full_like(b, -3.0) for b in sends]
            row_bytes = width * recv.element_size()
            for c, (_, _, lo, hi) in enumerate(layout.chunks):
                lane_sources = []
                local = recv[lo:hi].view(-1).view(torch.uint8)
                for sources, peer_at, local_at, sizes in layout.batches(c, lanes, row_bytes):
                    lane_sources.append(set(sources))
                    for s, p, at, n in zip(sources, peer_at, local_at, sizes):
                        local[at:at + n] = sends[s].view(-1).view(torch.uint8)[p:p + n]
                        backs[s].view(-1).view(torch.uint8)[p:p + n] = local[at:at + n]
                assert len(lane_sources) <= lanes
                assert all(not (a & b) for i, a in enumerate(lane_sources) for b in lane_sources[i + 1:])
            expect = _segment_rows(layout, sends, width)
            assert (expect >= 0).all() and torch.equal(recv, expect), (seed, rank)
            _check_returned(layout, rank, local_experts, backs, sends, seed)


def test_tapered_chunk_sizes():
    """taper: the first chunk (and past two chunks, the last) half the others'; every expert in one chunk, every
    chunk at least one; without taper, even chunks as before."""
    from uniep_dynamo.ep import OverlapConfig

    assert OverlapConfig(chunks=2, taper=True).chunk_sizes(32, 4) == (11, 21)
    assert OverlapConfig(chunks=3, taper=True).chunk_sizes(32, 4) == (8, 16, 8)
    assert OverlapConfig(chunks=4, taper=True).chunk_sizes(64, 4) == (11, 21, 21, 11)
    assert OverlapConfig(chunks=3).chunk_sizes(32, 4) == (11, 11, 10)
    for chunks in range(1, 9):
        for local in range(1, 40):
            sizes = OverlapConfig(chunks=chunks, taper=True).chunk_sizes(local, 4)
            assert sum(sizes) == local and min(sizes) >= 1 and len(sizes) == len(
                OverlapConfig(chunks=chunks).chunk_sizes(local, 4)), (chunks, local, sizes)


@pytest.mark.parametrize("world,local_experts,chunk,hot,empty_source", [
    (2, 4, 2, None, None),
    (4, 3, 2, 5, None),  # uneven chunks, a hot expert
    (4, 4, 1, None, 1),  # a source that sends nothing
])
def test_destinations_are_the_segments_rows(world, local_experts, chunk, hot, empty_source, monkeypatch):
    """The scattering GEMMs' table: receive row i goes back to row (peer row) of source s as (peer row) * 8 + s,
    from the Triton kernel (the interpreter here, as on the GPU) and from the torch ops of the plain CPU path."""
    for seed in range(3):
        counts = _counts(world, local_experts, seed, hot, empty_source)
        tokens = [sum(row) for row in counts]
        for rank in range(world):
            want = []
            layout = Layout(counts, tokens, 1, rank, world, local_experts, chunk, 8, 64)
            for c, (_, _, lo, hi) in enumerate(layout.chunks):
                rows = torch.full((hi - lo,), -1, dtype=torch.int64)
                for s, peer_row, row, n in layout.segments[c]:
                    rows[row:row + n] = torch.arange(peer_row, peer_row + n) * 8 + s
                want.append(rows)
            want = torch.cat(want) if want else torch.empty(0, dtype=torch.int64)
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            assert torch.equal(layout.destinations(torch.device("cpu")), want), (seed, rank)
            fresh = Layout(counts, tokens, 1, rank, world, local_experts, chunk, 8, 64)
            monkeypatch.setenv("TRITON_INTERPRET", "0")
            assert torch.equal(fresh.destinations(torch.device("cpu")), want), (seed, rank)
            on_device = Layout(counts, tokens, 1, rank, world, local_experts, chunk, 8, 64,
                               device_counts=torch.tensor([row + [t] for row, t in zip(counts, tokens)]))
            monkeypatch.setenv("TRITON_INTERPRET", "1")  # the tables by kernels.layout_tables
            assert torch.equal(on_device.destinations(torch.device("cpu")), want), (seed, rank)


@pytest.mark.parametrize("world,local_experts,sizes,dtype", [
    (1, 3, (3,), torch.int64),
    (2, 8, (3, 5), torch.int32),
    (3, 5, (1, 1, 2, 1), torch.int64),
    (4, 9, (1, 1, 1, 1, 1, 1, 1, 2), torch.int64),  # MAX_CHUNKS chunks
    (8, 2, (2,), torch.int32),
])
def test_device_tables_are_the_host_tables(world, local_experts, sizes, dtype):
    """kernels.layout_tables (the interpreter here, as on the GPU) lays out from the device's count table what the
    host lays out from its integers: the GEMMs' offsets, the destinations' runs and the transfer table, whose rows
    with rows are the segments, in order, with the blocks' running sums of the chunk."""
    from uniep_dynamo.kernels.triton_transfer import TABLE_COLUMNS, segment_table

    width, block = 24, 64
    for seed in range(4):
        counts = _counts(world, local_experts, seed, hot=seed % 3, empty_source=world - 1 if seed == 3 else None)
        counts[0][-1] = 0  # a pair without rows
        tokens = [sum(row) + 1 for row in counts]
        device_counts = torch.tensor([row + [t] for row, t in zip(counts, tokens)], dtype=dtype)
        for rank in range(world):
            host = Layout(counts, tokens, 1, rank, world, local_experts, sizes, width, block)
            dev = Layout(counts, tokens, 1, rank, world, local_experts, sizes, width, block,
                         device_counts=device_counts)
            cpu = torch.device("cpu")
            want, got = host._copy_to(cpu), dev._copy_to(cpu)
            assert want["table"].shape == (world * local_experts, TABLE_COLUMNS)
            for name in ("rel", "ends", "dest_runs", "table"):
                assert torch.equal(got[name], want[name]), (name, seed, rank)
            for c, (first, rows) in enumerate(host.table_chunks):
                table = got["table"][first:first + rows]
                flat, blocks = segment_table(host.segments[c], width, block)
                assert table[table[:, 3] > 0].reshape(-1).tolist() == flat, (seed, rank, c)
                assert int(table[-1, 4]) == blocks


def test_device_tables_refuse_more_chunks():
    from uniep_dynamo.kernels.triton_transfer import MAX_CHUNKS, layout_tables

    with pytest.raises(ValueError, match="chunks"):
        layout_tables(torch.zeros(2, 20, dtype=torch.int64), 0, MAX_CHUNKS + 1, list(range(MAX_CHUNKS + 1)), 8, 64)


def test_transfers_beside_the_chunks_gemms():
    from uniep_dynamo.ep.pipeline import _transfers_beside

    # (chunks, first chunk whose GEMM stores into the peers) -> transfer launches beside chunk c's GEMMs, c = 0..chunks
    # (the last entry: the work after the last chunk's GEMMs)
    cases = {(1, 0): [0, 0], (1, 1): [0, 1],  # one chunk: its pull goes alone, its push (if any) beside the after work
             (2, 0): [1, 0, 0], (2, 1): [1, 1, 0], (2, 2): [1, 1, 1],
             (4, 0): [1, 1, 1, 0, 0], (4, 3): [1, 2, 2, 1, 0], (4, 4): [1, 2, 2, 1, 1]}
    for (chunks, first_scatter), beside in cases.items():
        got = [_transfers_beside(c, chunks, first_scatter) for c in range(chunks + 1)]
        assert got == beside, f"{chunks} chunks, GEMM pushes from {first_scatter}: {got}"


def test_sm_carveout_is_set_within_and_restored(monkeypatch):
    from uniep_dynamo.ep import transfer

    monkeypatch.setattr(transfer, "sm_count", lambda device: 132)
    device = torch.device("cuda", 0)  # only its SM count is read (patched above)
    get = torch._C._get_sm_carveout_experimental
    before = get()
    with transfer.sm_carveout(0, device):
        assert get() == before
    try:
        with transfer.sm_carveout(8, device):
            assert get() == (before or 0) + 8
            with transfer.sm_carveout(16, device):
                assert get() == (before or 0) + 24
            assert get() == (before or 0) + 8
            with transfer.sm_carveout(500, device):
                assert get() == 66  # half the SMs at most
            with pytest.raises(RuntimeError):
                with transfer.sm_carveout(8, device):
                    raise RuntimeError("a GEMM failed")
            assert get() == (before or 0) + 8
        assert get() == before
        torch._C._set_sm_carveout_experimental(100)  # the user's own carve-out, above the cap, is kept
        with transfer.sm_carveout(8, device):
            assert get() == 100
        assert get() == 100
    finally:
        torch._C._set_sm_carveout_experimental(before)
