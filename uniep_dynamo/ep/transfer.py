"""The transfer paths of the overlapped EP layer: the symmetric-memory window, the copy streams and the copies.

Every rank keeps two rows buffers in symmetric memory, ``send`` and ``back`` (Window), which every peer can address;
the transfers are copies out of a peer's ``send`` (pull) and into a peer's ``back`` (push), on their own CUDA streams
(Streams): copy-engine copies (no SMs taken from the GEMMs), or SM copies (segment_copies: torch._foreach_copy_, or
the Triton transfer kernel of kernels/triton_transfer.py). copy_back copies a window's result rows out beside later
work; sm_carveout leaves the transfer kernel's SMs out of torch._grouped_mm's grid.

On CPU (CI) a shared file that every process maps stands in for symmetric memory, and the barrier is a gloo barrier.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import uuid

import torch
import torch.distributed as dist


class Window:
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
# (event, rows): copies out of a window's ``back`` on a stream of their own (copy_back), which no barrier may pass
_READS: list = []


def _wait_reads() -> None:
    for event, _ in _READS:
        torch.cuda.current_stream().wait_event(event)
    _READS.clear()


def copy_back(rows: torch.Tensor, out: torch.Tensor):
    """out <- rows (rows of a window's ``back``) on the device's copy-back stream, after the current stream's
    work, beside the work that follows; returns the event that a reader of ``out`` waits for. The next barrier
    of any window waits for it first (Window.barrier): the peers write ``back`` only after a phase's first
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


def window_key(group, dtype, hidden: int, device):
    return (group.group_name if hasattr(group, "group_name") else id(group), dtype, hidden, str(device))


def cached_window(group, dtype, hidden: int, device) -> Window | None:
    """The cached window of this group, dtype, width and device as it is, or None (window() makes or grows one)."""
    return _WINDOWS.get(window_key(group, dtype, hidden, device))


def window(group, capacity: int, hidden: int, dtype, device) -> Window:
    """The cached window of this group, dtype and width, grown (to a power of two rows) when a call needs
    more. Every rank takes the same decision: the capacity comes from the all-gathered table."""
    key = window_key(group, dtype, hidden, device)
    win = _WINDOWS.get(key)
    if win is None or win.capacity < capacity:
        for event, _ in _READS:  # the old window's memory goes once no copy reads it
            event.synchronize()
        win = Window(group, 1 << max(capacity - 1, 0).bit_length(), hidden, dtype, device)
        _WINDOWS[key] = win
    return win


class Streams:
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


def segment_copies(segments, local, peers, push: bool) -> None:
    """Every (source, row in its buffer, row in ``local``, rows) segment, pulled from peers[source] into local
    or pushed the other way, by one torch._foreach_copy_."""
    pairs = [(peers[s][peer_row:peer_row + n], local[row:row + n]) if push else
             (local[row:row + n], peers[s][peer_row:peer_row + n])
             for s, peer_row, row, n in segments]
    if pairs:
        dsts, srcs = zip(*pairs)
        torch._foreach_copy_(list(dsts), list(srcs))


@contextlib.contextmanager
def sm_carveout(sms: int, device):
    """Within it, torch._grouped_mm leaves ``sms`` more of the device's SMs out (torch's experimental SM carve-out,
    which its CUTLASS grouped GEMM reads at launch); 0: nothing changes. At most half the SMs are left out: the
    transfer kernel's launches beside a GEMM may ask for more programs than there are SMs, and CUTLASS refuses a
    grid of too few (a candidate of 4 chunks and 96 programs failed in the EP tuner with every SM but one left out)."""
    if sms <= 0 or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(max(before or 0, min((before or 0) + sms, sm_count(device) // 2)))
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


def sm_count(device) -> int:
    if device.type != "cuda":
        return 1
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNTS:
        _SM_COUNTS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNTS[key]


_SM_COUNTS: dict = {}
