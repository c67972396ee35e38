"""The steps of a batch of calls, the same code on both sides of the boundary.

The worker runs them with the solution's call; the judge runs them without it (`invoke` does
nothing) to learn what the harness's own steps cost, and subtracts that from the time it measured
around the worker's batch. A batch draws its fresh data first; then each call: a window of its
set's random inputs redrawn (when the call has a seed), the L2 flushed, its queries' column signs
set from what the flush returned, then the call between two clock readings. A call's own host work is a few launches, so on a GPU a batch is bound by the
device's time, which is what the judge's clock has to see.

What a call redraws: every random input with a row per output row whole (workloads.whole_redrawn:
the queries), a window of every random input, and of every input a generator makes that carries
data (an FP8 KV cache: fresh tokens quantised as the generator quantises them, only in the rows
that carry data); index structure never changes. The worker does it in its arena, the judge
on its own copies: InputSets is the one code path of both.

Each call's redraw also depends on the outputs of the call before it (output_link): its windows are
rotated and (without a query) its cache scaled by amounts derived from a number reduced from those
outputs, mixed with the call's seed (mixed_link, window_shifts; LinkedRedraw); the flush's read passes
are keyed by the same number, and the signs of the queries' columns (negated_columns) come from what
they return (L2Flush), so the flush runs between the two calls and nowhere else. A call's outputs
must therefore be final when the next call's steps begin. Work a call leaves running after it returns
(on another stream, in a thread) would have the next inputs drawn from unfinished outputs, which the
judge sees when it checks the link of every call (docs/threat_model.md, class 5b, says what a
worker that rewrites these steps can still do).
"""

import contextlib
import functools
import math
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..model import Definition, Workload
from ..workloads import (DEFAULT_RANDOM, GeneratedData, data_window_copies, data_window_spans, draw_data_windows,
                         draw_windows, redrawn_data, refill_whole, scalable, symmetric, whole_redrawn, window_copies,
                         window_elements, window_spans, window_starts)
from .protocol import Batch, Call

FLUSH_BYTES = 256 << 20  # over 4x the H200's 60 MB L2
# The read is done this many times over. One pass would do for the L2; the others keep the device busy
# for longer than the host takes to issue a call with its harness steps (on the H200 the steps took
# 120-220 µs of host time per call in an earlier form, 90-150 µs now, against about 325 µs of device
# time: docs/measurement.md, "v9"), so the device, never the host, bounds a batch: then the judge's
# clock and CUDA events see only the call.
READ_PASSES = 3
# Changing what a flush does changes every timing: the version is recorded with each trace.
FLUSH_METHODS = {
    "read": "reads one 256 MiB buffer of random bytes 3 times, each pass keyed by the previous call's outputs and "
            "the pass before: no input resident but the queries, no dirty line left but theirs",
    "write+read": "writes one 256 MiB buffer, then the keyed reads of `read` (the write is keyed by nothing)",
    "write": "writes one 256 MiB buffer (leaves dirty lines whose write-back the next call pays)",
    "none": "no flush: a warm L2",
}
FLUSH_VERSION = 4
DEFAULT_FLUSH = "read"


def flush_label(method: str) -> str:
    """How a trace names the L2's state before its timed calls."""
    return "not flushed (warm)" if method == "none" else f"flushed: {method} v{FLUSH_VERSION}"


def captured(launch: Callable[[], object], device: torch.device) -> tuple[torch.cuda.CUDAGraph, object]:
    """`launch`'s kernels captured in a CUDA graph on `device` (replaying it runs them again), and what it
    returned: tensors of the graph's own, which every replay writes anew."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: another lane's thread may use the device (its own) meanwhile
    with torch.cuda.device(device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = launch()
    return graph, outputs


# A keyed read pass is a product of the flush buffer, as rows of KEYED_WIDTH random bytes, with a key
# matrix of KEY_COLUMNS columns of bytes (an int8 matrix product: exact, in any order of summation), its
# result reduced to one number through a step no sum commutes with. The judge draws the buffer from a
# secret seed and writes it into the job's arena, so the worker's flush reads the same bytes and cannot
# make them again (from a seed it knew, a worker could regenerate the bytes in registers, never reading
# them); the key is made from the previous call's link and the pass before, so no part of a pass can
# run before the previous call's outputs are final, and its result is known only once every byte of the
# buffer was read.
KEYED_WIDTH = 16384  # products stay under 2^28: exact in the int32 the product accumulates in
# Columns of each pass's key matrix: an int8 product takes a multiple of 8; on an H100 one pass over
# 256 MiB took 151 µs with 8 and 113 µs with 16, against 109 µs for a sum of the same bytes as float32
# (docs/data/clock_study_h100/v12_keyed_pass.txt; `python benchmarks/keyed_flush.py` measures the same).
KEY_COLUMNS = 16
FLUSH_SALT = 0xC2B2AE3D


class L2Flush:
    """Puts the L2 cache in one defined state before every call (runs use "none" on a CPU), and ties the
    next call to having done so: called with the previous call's link and the call's keys (link_keys), it
    returns the number the call's query signs are set from (InputSets.flip). With `read` passes that
    number is the link carried through each pass's product with the buffer (keyed_pass), so a worker that
    skips, shortens or moves a pass gets the next call's inputs wrong, and the judge recomputes it for every
    timed call; the other methods return the link as it is. On a GPU the flush's launches are
    captured once in a CUDA graph and replayed: the same kernels on the device, one launch for the host to
    issue (see READ_PASSES)."""

    def __init__(self, method: str, device: str, nbytes: int = FLUSH_BYTES, read_buffer: torch.Tensor | None = None):
        if method not in FLUSH_METHODS:
            raise ValueError(f"no L2 flush method {method!r}; known: {', '.join(FLUSH_METHODS)}")
        self.method, self.nbytes = method, nbytes
        self._written = self._read = self._graph = self._flushed = None
        self._device = torch.device(device)
        self._on_gpu = self._device.type == "cuda" and method != "none"
        if "write" in method:
            self._written = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if "read" in method:
            self._read = read_buffer if read_buffer is not None else random_bytes(nbytes, self._device)
            # The graph reads its link and keys from these, and writes its result to the same tensor, every replay.
            self._link = torch.zeros((), dtype=torch.int64, device=device)
            self._keys = torch.zeros(4, dtype=torch.int64, device=device)

    @property
    def keyed(self) -> bool:
        return self._read is not None

    @property
    def read_buffer(self) -> torch.Tensor | None:
        """The bytes the keyed passes read (the judge's, which it writes into each job's arena)."""
        return self._read

    def __call__(self, link: torch.Tensor | int | None = None, keys: torch.Tensor | None = None):
        """Flush; the number the call's query signs come from: a fresh 0-d int64 tensor for a keyed flush
        (`link` None counts as 0), else `link` as given."""
        if self.keyed:
            if isinstance(link, torch.Tensor):
                self._link.copy_(link)
            else:
                self._link.fill_(link or 0)
            if keys is None:
                self._keys.zero_()
            else:
                self._keys.copy_(keys)
        if self._graph is not None:
            self._graph.replay()
            flushed = self._flushed
        else:
            flushed = self._launch()
            if self._on_gpu:  # after one flush issued as it is, the same launches captured (capturing runs nothing)
                self._graph, self._flushed = captured(self._launch, self._device)
        return flushed.clone() if self.keyed else link

    def _launch(self) -> torch.Tensor | None:
        if self._written is not None:
            self._written.zero_()
        if not self.keyed:
            return None
        mixed = self._link
        for index in range(READ_PASSES):
            mixed = keyed_pass(self._read, mixed, self._keys, index)
        return mixed


def random_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """About `nbytes` int8 values as rows of KEYED_WIDTH, from a seed no one is told."""
    rows = max(nbytes // KEYED_WIDTH, 17)  # an int8 product takes more than 16 rows
    generator = torch.Generator(device=device).manual_seed(secrets.randbits(63))
    return torch.randint(-128, 128, (rows, KEYED_WIDTH), dtype=torch.int8, device=device, generator=generator)


def keyed_pass(buffer: torch.Tensor, link: torch.Tensor, keys: torch.Tensor, index: int) -> torch.Tensor:
    """One read pass over `buffer` (rows of KEYED_WIDTH int8) keyed by `link` (0-d int64): the link mixed
    with the product's digest, in [0, LINK_PRIME). A sum of the product would be a fixed combination of
    the buffer's column sums, known without reading it; the exclusive or with a shift of each element
    makes every element count on its own."""
    mixed = _mix(link + index, keys.unbind())
    key = (_multipliers(KEYED_WIDTH * KEY_COLUMNS, buffer.device, FLUSH_SALT) * mixed).remainder_(LINK_PRIME)
    key = key.bitwise_and_(0xFF).to(torch.uint8).view(torch.int8).view(KEY_COLUMNS, KEYED_WIDTH).t()
    product = torch._int_mm(buffer, key)
    digest = product.bitwise_xor(product >> 13).sum(dtype=torch.int64)
    return _mix(digest + mixed, keys.unbind())


# What a call without a query scales rather than rotates (InputSets): multiplied element by element.
SCALED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The integer type a tensor's raw words are summed as (and its sign bit flipped in), by element size.
WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SIGN_BITS = {1: 0x80, 2: -(1 << 15), 4: -(1 << 31), 8: -(1 << 63)}  # a float's sign bit, in its word type


def output_link(outputs: list[torch.Tensor]) -> torch.Tensor:
    """A call's outputs reduced to one number, the link the next call's redraw is rotated by: the sum of
    each output's raw words, weighted by an odd number per output. A 0-d int64 tensor on the outputs'
    device, so the worker never waits for it. Integer sums are exact in any order: the judge gets the
    same number from the bytes it reads."""
    link = None
    for i, tensor in enumerate(outputs):
        total = word_sum(raw_words(tensor))
        link = total if link is None else link + total * (2 * i + 1)
    return link


def raw_words(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as integer words of their size, one dimension: bit for bit (NaN payloads, -0.0)."""
    return tensor.reshape(-1).view(WORD_DTYPES[tensor.element_size()])


# Words summed at once. A sum into int64 first copies its input to int64, 8 bytes a word: for the 2.3 GB bf16
# output of the largest MHA varlen workload, 9 GB more on the device in the judge and in the worker, which an
# 80 GB H100 did not hold beside the job's sets. In pieces, the copy stays at 256 MB.
LINK_PIECE_WORDS = 1 << 25


def word_sum(words: torch.Tensor) -> torch.Tensor:
    """The exact sum of integer `words` (one dimension) as a 0-d int64 tensor, a piece at a time."""
    if words.numel() <= LINK_PIECE_WORDS:
        return words.sum(dtype=torch.int64)
    return torch.stack([piece.sum(dtype=torch.int64) for piece in words.split(LINK_PIECE_WORDS)]).sum()


# A window's rotation comes from the link through a non-linear mix keyed by the call's seed, modulo this
# prime, times a multiplier of the window's own, modulo it again: every window depends on 31 bits of the
# mix, and each on them differently. The link alone is a sum, and a worker that rewrites these steps can
# nudge finished outputs within the tolerance until their sum is one it picked before they were done
# (a red team built it: every link picked in advance). Through the mix, hitting a picked rotation takes
# trying about 2^31 sums; the key is secret until the batch arrives, so no table made earlier helps.
# Every value stays under 2^63, so the worker's tensors and the judge's integers agree exactly.
LINK_PRIME = (1 << 31) - 1
KEY_BITS = 29  # keys under 2^29: (x + key) * (y + key') stays under 2^63 for x, y < 2^31


def window_shifts(mixed: torch.Tensor | int, windows: int, device) -> torch.Tensor:
    """The rotation of each of a call's `windows` windows (int64, in [0, LINK_PRIME)) from the call's
    mixed link (mixed_link)."""
    return (_multipliers(windows, torch.device(device), WINDOW_SALT) * mixed).remainder_(LINK_PRIME)


def negated_columns(mixed: torch.Tensor | int, width: int, device) -> torch.Tensor:
    """For each of `width` columns, 1 where a query's column is negated (int64 0/1), from the call's mixed
    link. Every column's sign depends on all 31 bits of the mix, so a worker that wants them before the
    previous call's outputs are final has to hit the whole mix (a rotation of n rows, an earlier form,
    needed only ~n tries: a red team hit one of 128 in 29)."""
    return (_multipliers(width, torch.device(device), SIGN_SALT) * mixed).remainder_(LINK_PRIME).bitwise_and_(1)


def mixed_link(link: torch.Tensor | int, seed: int) -> torch.Tensor | int:
    """The link through three rounds that mix products modulo LINK_PRIME with exclusive or (operations
    that share no algebra, so no round undoes another), keyed by the seed; in [0, LINK_PRIME). The same
    operators on a 0-d tensor (LinkedRedraw: launches, no wait) and on an integer."""
    return _mix(link, _link_keys(seed))


def link_keys(seeds: list[int], device) -> torch.Tensor:
    """The keys of mixed_link for each seed, as rows of an int64 tensor on `device`: made once per batch, so
    that a call's mix takes its keys from the device and the host copies nothing while the calls run."""
    return torch.tensor([_link_keys(seed) for seed in seeds], dtype=torch.int64, device=device).reshape(-1, 4)


def _mix(link, keys):
    """mixed_link with its keys given: four integers, or a tensor of four."""
    k0, k1, k2, k3 = keys
    a = link % LINK_PRIME
    b = link // LINK_PRIME % LINK_PRIME
    a = (a + k0) * (b + k1) % LINK_PRIME
    b = ((a ^ b) + k2) * (a + k3) % LINK_PRIME
    return ((a ^ b) + k1) * (b + k0) % LINK_PRIME


def _link_keys(seed: int) -> tuple[int, int, int, int]:
    """Four keys in [1, 2^KEY_BITS) from the seed (splitmix64 steps)."""
    keys, state = [], seed
    for _ in range(4):
        state = (state + 0x9E3779B97F4A7C15) & (2**64 - 1)
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        keys.append((z ^ (z >> 31)) % ((1 << KEY_BITS) - 1) + 1)
    return tuple(keys)


WINDOW_SALT, SIGN_SALT = 0x9E3779B1, 0x85EBCA77


@functools.cache
def _multipliers(count: int, device: torch.device, salt: int) -> torch.Tensor:
    """`count` multipliers: distinct, non-zero modulo LINK_PRIME (made once: a call's steps are launches)."""
    return (torch.arange(1, count + 1, dtype=torch.int64, device=device) * salt) % LINK_PRIME


def link_values(links: list[torch.Tensor | int | None]) -> list[int]:
    """The links a batch used, as integers (0 for a call that used none), the tensors read in one transfer."""
    used = [link for link in links if isinstance(link, torch.Tensor)]
    values = iter(torch.stack(used).tolist() if used else [])
    return [next(values) if isinstance(link, torch.Tensor) else link or 0 for link in links]


def linked_calls(calls: list[Call]) -> list[int]:
    """The calls of a batch whose redraw depends on the previous call's outputs: every call with a seed
    but the first."""
    return [k for k in range(1, len(calls)) if calls[k].seed is not None]


class CallClock:
    """The worker's own per-call times: CUDA events on a GPU, the host clock on a CPU. Made once per job
    for as many calls as a batch can hold: making hundreds of CUDA events takes a millisecond or more
    of host time, which inside a batch the judge's clock would count and its baseline would not."""

    def __init__(self, device: str, capacity: int):
        self.on_gpu = torch.device(device).type == "cuda"
        self.device = device
        self.calls = 0
        self.issue_ms = 0.0  # the last batch's, to its last call: see CallTimes
        self._starts: list = []
        self._ends: list = []
        self._grow(capacity)

    def begin(self, calls: int) -> None:
        """A batch of `calls` calls starts."""
        if calls > len(self._starts):
            self._grow(calls)
        self.calls = calls

    def _grow(self, capacity: int) -> None:
        missing = capacity - len(self._starts)
        if self.on_gpu:
            self._starts += [torch.cuda.Event(enable_timing=True) for _ in range(missing)]
            self._ends += [torch.cuda.Event(enable_timing=True) for _ in range(missing)]
        else:
            self._starts += [0.0] * missing
            self._ends += [0.0] * missing

    def start(self, k: int) -> None:
        if self.on_gpu:
            self._starts[k].record()
        else:
            self._starts[k] = time.perf_counter()

    def stop(self, k: int) -> None:
        if self.on_gpu:
            self._ends[k].record()
        else:
            self._ends[k] = time.perf_counter()

    def times_ms(self) -> list[float]:
        """The last batch's, after its device-wide synchronisation."""
        pairs = zip(self._starts[:self.calls], self._ends[:self.calls])
        if self.on_gpu:
            return [s.elapsed_time(e) for s, e in pairs]
        return [(e - s) * 1e3 for s, e in pairs]


class LinkedRedraw:
    """What a call's redraw takes from its link and its keys (a row of link_keys): a rotation (window_shifts; on
    a GPU an index of n positions, on a CPU the shift itself, applied by `rotated`) for each of `lengths`, the
    sign-bit mask of `width` query columns (negated_columns) for each word size in `sizes`, and a factor in [1, 2)
    (float32, from all 31 bits of the mix). About thirty small launches: on a GPU captured once in a CUDA
    graph and replayed, one launch for the host. Issued one by one, with the rest of the steps,
    they took the host longer than the device took for the flush and the call (on an H100 the steps read
    0.6-1.1 ms a call against the flush's 0.52: docs/measurement.md, "v11"), and the judge's clock
    measured the host."""

    def __init__(self, lengths: tuple[int, ...], width: int, sizes: tuple[int, ...], device: torch.device):
        self.lengths, self.width, self.sizes = lengths, width, sizes
        self._on_gpu = device.type == "cuda"
        # The graph reads its inputs from these and writes its outputs to the same tensors every replay.
        self._link = torch.zeros((), dtype=torch.int64, device=device)
        self._keys = torch.zeros(4, dtype=torch.int64, device=device)
        # A GPU's rotations are indices made in the graph; a CPU's are shifts applied by slicing, the cheapest way
        # to the same rows: the judge subtracts these steps' cost from a worker's batches (docs/threat_model.md).
        self._positions = [torch.arange(n, dtype=torch.int64, device=device) for n in lengths] if self._on_gpu else []
        self._graph = self._outputs = None

    def __call__(self, link: torch.Tensor | int,
                 keys: torch.Tensor) -> tuple[list[torch.Tensor | int], dict, torch.Tensor]:
        """(rotations, {word size: mask}, factor) for `link` (the worker's 0-d tensor or the judge's integer)."""
        if isinstance(link, torch.Tensor):
            self._link.copy_(link)
        else:
            self._link.fill_(link)
        self._keys.copy_(keys)
        if self._graph is not None:
            self._graph.replay()
            return self._outputs
        outputs = self._derive()
        if self._on_gpu:  # after one run as it is, the same launches captured
            self._graph, self._outputs = captured(self._derive, self._link.device)
        return outputs

    def _derive(self) -> tuple[list[torch.Tensor], dict, torch.Tensor]:
        device = self._link.device
        mixed = _mix(self._link, self._keys.unbind())
        shifts = window_shifts(mixed, len(self.lengths), device)
        if self._on_gpu:
            rotations = [(positions + shift).remainder_(len(positions))
                         for positions, shift in zip(self._positions, shifts)]
        else:
            rotations = [shift % n if n else 0 for shift, n in zip(shifts.tolist(), self.lengths)]
        negated = negated_columns(mixed, self.width, device)
        factor = mixed.to(torch.float32).mul_(2.0 ** -31).add_(1.0)
        return rotations, {size: (negated * SIGN_BITS[size]).to(WORD_DTYPES[size]) for size in self.sizes}, factor


def rotated(source: torch.Tensor, rotation: torch.Tensor | int) -> torch.Tensor:
    """`source`'s rows rotated (LinkedRedraw): row i of the result is row (i + shift) % n of `source`, by an index
    of the n positions (a GPU's) or by slicing at the shift (a CPU's, an int): the same rows."""
    if isinstance(rotation, int):
        rotation %= max(source.shape[0], 1)
        return torch.cat((source[rotation:], source[:rotation]))
    return source.index_select(0, rotation)


def rotated_copies(target: torch.Tensor, source: torch.Tensor,
                   rotation: torch.Tensor | int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) pairs whose copies write `source`'s rows rotated into `target`: with a shift, its two
    slices straight into place (no rotated copy made first)."""
    if isinstance(rotation, int):
        rotation %= max(source.shape[0], 1)
        count = source.shape[0] - rotation
        return [(target[:count], source[rotation:]), (target[count:], source[:rotation])]
    return [(target, source.index_select(0, rotation))]


@dataclass
class InputSets:
    """The tensor inputs of each set and how a batch redraws part of their data: one draw of fresh
    data per input for the whole batch, and of where each call's windows go (from the batch's seed and
    its calls' seeds), then per call its window of that data written in place: one multi-tensor copy
    (and an indexed copy per input whose data rows are scattered). `random_names` are the random
    inputs; the generated inputs that carry data (`data`) are found from the workload here, so that
    whoever builds an InputSets (the worker, the judge's replay, the judge's baseline) redraws them alike."""

    definition: Definition
    workload: Workload
    sets: list[dict[str, torch.Tensor]]
    random_names: list[str]
    data: dict[str, GeneratedData] = field(init=False)
    _spans: dict[str, int] = field(init=False)  # the last offset each input's window can start at
    _calls: list[Call] = field(default_factory=list, init=False)  # the batch drawn last, and its draws
    _fresh: dict = field(default_factory=dict, init=False)
    _fresh_data: dict = field(default_factory=dict, init=False)
    _starts: dict = field(default_factory=dict, init=False)
    _keys: torch.Tensor | None = field(default=None, init=False)  # link_keys of the batch's calls
    _linked: dict = field(default_factory=dict, init=False)  # a LinkedRedraw by what it derives
    _queries: list[str] = field(init=False)  # random inputs with a row per output row (workloads.whole_redrawn)
    _whole: list[str] = field(init=False)  # those of them each call draws whole (a window covers the others)
    _signed: list[str] = field(init=False)  # those of them whose columns' signs each call sets
    _generators: dict = field(default_factory=dict, init=False)
    _moved: list[str] = field(init=False)  # where nothing is drawn whole: inputs whose rows each call rotates
    _scaled: list[str] = field(init=False)  # ... and floating-point inputs each call scales instead
    _first: dict = field(default_factory=dict, init=False)  # (set, name) -> a scaled input's first values, float32+

    def __post_init__(self):
        # Not those a window already covers whole: its copy would overwrite the whole draw.
        self._queries = whole_redrawn(self.definition, self.random_names)
        self._whole = [name for name in self._queries
                       if window_elements(self.sets[0][name]) < self.sets[0][name].numel()]
        # Signs flipped only where that leaves the distribution as drawn (not probabilities, say).
        self._signed = [name for name in self._queries if symmetric(self.workload.inputs.get(name, DEFAULT_RANDOM))]
        self.data = redrawn_data(self.definition, self.workload, self.sets[0])
        self._spans = {**window_spans(self.sets[0], self.random_names), **data_window_spans(self.sets[0], self.data)}
        # Without a query, a window changes a few output rows, and which ones the worker knows (it writes
        # them): it could keep the others from the call before. Moving every row keeps none in place, but
        # a worker that knows the move can move its outputs alike (a red team's FP8 quantize did, 5x faster
        # on a CPU). Values scaled by a factor that is no power of two change every output in a way no
        # output of the call before gives: floating-point data a generator makes, and random inputs drawn
        # about zero, are scaled; the others (packed bytes, where moving outputs costs more than computing
        # them; values whose range matters) rotated.
        changing = [] if self._queries else [name for name in self.redrawn_names if self._spans.get(name, 0) > 0]
        self._scaled = [name for name in changing if self.sets[0][name].dtype in SCALED_DTYPES and (
            name in self.data or scalable(self.workload.inputs.get(name, DEFAULT_RANDOM)))]
        self._moved = [name for name in changing if name not in self._scaled]

    def draw(self, seed: int, calls: list[Call]) -> None:
        like = self.sets[0]
        self._calls = calls
        self._fresh = draw_windows(self.definition, self.workload, like, self.random_names, seed, len(calls))
        self._fresh_data = draw_data_windows(self.workload, like, self.data, seed, len(calls))
        self._starts = window_starts(seed, [call.seed or 0 for call in calls], self._spans)
        self._keys = link_keys([call.seed or 0 for call in calls], next(iter(like.values())).device)

    def redraw(self, k: int, link: torch.Tensor | int | None = None) -> None:
        """Call `k` of the batch drawn last, on its set (nothing without a seed): the inputs with a row per
        output row (the queries) drawn afresh whole, or where there are none every redrawn input set to its
        values before the first call times a factor (floating point) or its rows rotated (other types); its
        windows written, each rotated. Rotations and factor come from the mix of `link` (output_link of the
        call before, the judge passing the integer; none for the batch's first call) and the call's seed.
        The queries' signs are set after the L2 flush (flip)."""
        call = self._calls[k]
        if call.seed is None:
            return
        inputs = self.sets[call.set]
        sliced, indexed = data_window_copies(inputs, self.data, self._fresh_data, k, self._starts)
        copies = window_copies(inputs, self._fresh, k, self._starts) + sliced
        moved = [self._row_table(inputs[name], name) for name in self._moved]
        if not (self._queries or self._scaled or moved or copies or indexed):
            return
        for name in self._scaled:  # the set as written before its first call (on both sides alike)
            if (call.set, name) not in self._first:
                # In float32 (exact for every scaled type but float64): multiplied as it is, a 16-bit input would
                # have the factor rounded to its own type on a GPU, leaving 129 factors, few enough to keep a
                # table of outputs for each (a red team's finding from CUDA's type rules).
                self._first[call.set, name] = inputs[name].to(torch.promote_types(inputs[name].dtype, torch.float32))
        refill_whole(self.workload, inputs, self._whole, call.seed, self._generators)
        lengths = ([table.shape[0] if rows is None else rows.shape[0] for table, rows in moved]
                   + [source.shape[0] for _, source in copies] + [window.shape[0] for _, _, window in indexed])
        rotations, _, factor = self._linked_redraw(tuple(lengths), [])(0 if link is None else link, self._keys[k])
        for name in self._scaled:
            torch.mul(self._first[call.set, name], factor, out=inputs[name])
        rotations = iter(rotations)
        for table, rows in moved:
            self._move_rows(table, rows, next(rotations))
        copies = [pair for target, source in copies for pair in rotated_copies(target, source, next(rotations))]
        indexed = [(table, rows, rotated(window, next(rotations))) for table, rows, window in indexed]
        if copies:
            torch._foreach_copy_([target for target, _ in copies], [source for _, source in copies])
        for table, rows, window in indexed:
            table.index_copy_(0, rows, window)

    def flip(self, k: int, flushed: torch.Tensor | int | None) -> None:
        """Call `k`'s queries' columns' signs set from `flushed` (what the L2 flush before the call returned:
        L2Flush), after the flush: the call cannot start before the flush's keyed reads are done."""
        call = self._calls[k]
        columns = self._column_tables([self.sets[call.set][name] for name in self._signed])
        if call.seed is None or not columns:
            return
        _, masks, _ = self._linked_redraw((), columns)(0 if flushed is None else flushed, self._keys[k])
        self._flip_columns(columns, masks)

    def keys(self, k: int) -> torch.Tensor:
        """Call `k`'s keys (link_keys) of the batch drawn last."""
        return self._keys[k]

    def _linked_redraw(self, lengths: tuple[int, ...], columns: list[torch.Tensor]) -> LinkedRedraw:
        width = max((table.shape[1] for table in columns), default=0)
        sizes = tuple(sorted({table.element_size() for table in columns}))
        key = (lengths, width, sizes)
        if key not in self._linked:
            self._linked[key] = LinkedRedraw(lengths, width, sizes, self._keys.device)
        return self._linked[key]

    @staticmethod
    def _column_tables(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each floating-point tensor viewed as rows of its first axis (its columns: all the rest)."""
        return [tensor.view(tensor.shape[0], math.prod(tensor.shape[1:])) for tensor in tensors
                if tensor.is_floating_point() and tensor.dim() > 1 and tensor.numel() > 0]

    @staticmethod
    def _flip_columns(tables: list[torch.Tensor], masks: dict[int, torch.Tensor]) -> None:
        """Each table (_column_tables) has the columns its word size's mask marks negated: its words' sign bit
        flipped (exact in every floating-point type, FP8 included). No part of the next call's attention can
        be computed before the previous call's outputs are final: every score depends on the signs of its
        query's columns."""
        for table in tables:
            size = table.element_size()
            table.view(WORD_DTYPES[size]).bitwise_xor_(masks[size][:table.shape[1]])

    def _row_table(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An input as the table of rows a call rotates, and which of them carry data (None: all)."""
        spec = self.data.get(name)
        return (tensor, None) if spec is None else (tensor.view(-1, spec.width), spec.rows)

    @staticmethod
    def _move_rows(table: torch.Tensor, rows: torch.Tensor | None, rotation: torch.Tensor | int) -> None:
        """`table`'s rows (those in `rows`, among themselves) rotated in place: every output row's input moves
        on every call, so outputs kept from the call before are in the wrong rows."""
        if rows is None:
            table.copy_(rotated(table, rotation))
        else:
            table.index_copy_(0, rows, table.index_select(0, rotated(rows, rotation)))

    @property
    def redrawn_names(self) -> list[str]:
        """Every input a call redraws a window of."""
        return [*self.random_names, *self.data]


def run_batch(batch: Batch, inputs: InputSets, flush: L2Flush, invoke: Callable[[Call], None],
              after: Callable[[Call], None], clock: CallClock,
              outputs: Callable[[Call], list[torch.Tensor]], given_links: list | None = None) -> tuple[list, list]:
    """`invoke` is timed by `clock`; `after` (moving returned outputs into their slot) is not; `outputs`
    gives the slot a call's outputs are then in. Returns the link each call's redraw used (None: none)
    and what the flush before each call returned (the signs' link, L2Flush). `given_links` (the judge's
    run of the steps) replaces the links taken from `outputs` by those the worker reported, so that each
    flush is keyed as the worker's was; the links from `outputs` are still computed, as the worker's are."""
    start = time.perf_counter()
    clock.begin(len(batch.calls))
    inputs.draw(batch.fresh_seed, batch.calls)
    links: list[torch.Tensor | None] = [None] * len(batch.calls)
    flushed: list[torch.Tensor | None] = [None] * len(batch.calls)
    linked = set(linked_calls(batch.calls))
    for k, call in enumerate(batch.calls):
        inputs.redraw(k, links[k])
        flushed[k] = flush(links[k], inputs.keys(k))
        inputs.flip(k, flushed[k])
        clock.start(k)
        invoke(call)
        clock.stop(k)
        after(call)
        if k + 1 in linked:
            # Computed on both sides: the judge's run of the steps must cost what the worker's does, or the
            # difference is charged to the solution (docs/measurement.md, "v13").
            link = output_link(outputs(call))
            links[k + 1] = link if given_links is None else given_links[k + 1]
    clock.issue_ms = (time.perf_counter() - start) * 1e3
    synchronize(clock.device)
    return links, flushed


# On a CPU the harness's steps are timed with one intra-op thread, in the worker and in the judge's
# baseline alike: with a pool of threads every op waits for its slowest thread, and on a loaded host
# the judge's readings of a 1.4 ms step reached 68 ms, so that a solution's figure (its batch less
# the steps) fell below its own 20 ms of sleep per call. With one thread they stayed at 1.4 ms.
CPU_THREADS = 1
_threads_lock = threading.Lock()  # the thread count is the process's: baselines on CPU lanes take turns


@contextlib.contextmanager
def steps_threads(device: str):
    """CPU_THREADS intra-op threads while the harness's steps are timed on a CPU; as they were after."""
    if torch.device(device).type != "cpu":
        yield
        return
    with _threads_lock:
        before = torch.get_num_threads()
        torch.set_num_threads(CPU_THREADS)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release_cached_memory(device: str) -> None:
    """Give the device memory this process's allocator keeps cached back to the driver. A worker is
    a process of its own and cannot use it. Without this, on the H200, solutions asking for 0.3-12 GB
    found the 141 GB device full after the largest workloads' references and arenas."""
    if torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
