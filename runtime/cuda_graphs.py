"""CUDA execution of program methods: token/batch buckets, padding to a bucket, and graph capture/replay.

A `GraphRunner` serves one program method on CUDA. Per bucket (the padded size of the
method's leading dimension) it warms the method up once on padding-only inputs, captures
`call(static_inputs)` (the method run with its caller's op bindings) in a CUDA graph, and from
then on copies each call's inputs into the static buffers and replays. The index inputs (int64: tokens,
positions, slots, placement) are views of one buffer, so host ones go in one copy. A call may pass only its
live rows: an index input's padding rows are then its blank rows (the scratch slot, so they change no live
sequence); a payload input's (floats: hidden rows) keep what an earlier call left there, which only padding
rows read. A capture remembers the
storage version of the cache it reads (`version()`); when the cache moved its storage
(growth), the graph is captured again (a recapture) before the next replay.

Callers own what happens outside the graph: admission (on the host, before the replay: row by row with
the padding rows, or by span without them), and consuming the outputs before the
next replay of the same runner (outputs are static buffers that the next replay reuses).

Also here: the one decision "Triton attention or the torch reference" for a cache on a
device, which says why once when CUDA has to fall back.

Knows torch.cuda; must not know programs, models, caches' internals, the scheduler or mg.export.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger("mg.runtime")
_SAID: set[str] = set()


def say_once(message: str) -> None:
    """Log a fallback reason (Triton to torch, graphs to eager) once per process."""
    if message not in _SAID:
        _SAID.add(message)
        log.warning(message)


# ------------------------------------------------------------------ Triton choice


def triton_enabled(device: torch.device, requested: Optional[bool] = None) -> bool:
    """Use the Triton attention kernels? None = on CUDA whenever Triton can run; True/False force.
    On CUDA without Triton, says why once and picks the torch reference."""
    from mg.kernels import triton_attention

    if requested is not None:
        if requested and not triton_attention.available():
            raise ValueError(f"use_triton=True, but Triton attention is unavailable: {triton_attention.reason}")
        return requested
    if torch.device(device).type != "cuda":
        return False
    if not triton_attention.available():
        say_once(f"mg-run: Triton attention unavailable ({triton_attention.reason}); "
                 f"using the torch reference attention on CUDA")
        return False
    return True


# ------------------------------------------------------------------ buckets and padding


def buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `limit`, then `limit` itself: every padded size a runner may capture."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return (*out, limit)


def bucket_for(n: int, limit: int) -> Optional[int]:
    """The smallest bucket >= n (n >= 1), or None when n > limit."""
    if n > limit:
        return None
    b = 1
    while b < n:
        b *= 2
    return min(b, limit)


# ------------------------------------------------------------------ graphs


@dataclass
class GraphCounters:
    captures: int = 0  # first captures and recaptures
    replays: int = 0
    recaptures: int = 0  # captures again after the cache's storage moved


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: list  # static input buffers [bucket, ...]
    outputs: list  # static outputs, overwritten by every replay
    version: int  # the storage version the graph read
    flat: Optional[torch.Tensor] = None  # one buffer the index inputs are views of (`_static_inputs`)
    joined: tuple = ()  # which inputs are views of `flat`, in order
    blank: tuple = ()  # the index inputs' blanks on the device (None for others): padding rows (`GraphRunner.run`)
    host_blank: dict = None  # input -> its blank on the host, for the inputs of `flat`


def _static_inputs(blank: list) -> tuple[list, Optional[torch.Tensor], tuple]:
    """The static input buffers of a capture, filled with `blank`: the index inputs (int64) are views of one
    flat buffer (so host ones are copied in at once), every other input a buffer of its own. -> (buffers, flat
    or None, the inputs that are views of flat)."""
    joined = tuple(i for i, t in enumerate(blank) if t.dtype == torch.long)
    views = [t.clone() if i not in joined else None for i, t in enumerate(blank)]
    if not joined:
        return views, None, ()
    flat = torch.cat([blank[i].reshape(-1) for i in joined])
    at = 0
    for i in joined:
        views[i] = flat.narrow(0, at, blank[i].numel()).view(blank[i].shape)
        at += blank[i].numel()
    return views, flat, joined


class GraphRunner:
    """Captures one method per bucket and replays it; see the module docstring."""

    def __init__(self, call: Callable[[list], list], blank: Callable[[int], list], version: Callable[[], int],
                 counters: GraphCounters):
        """`call(inputs)` runs the method; `blank(bucket)` returns padding-only device inputs of that bucket
        (harmless to run: scratch slot, position 0); `version()` the storage version of the cache it reads."""
        self.call = call
        self.blank = blank
        self.version = version
        self.counters = counters
        self._graphs: dict[int, _Captured] = {}
        self._ever: set[int] = set()
        self._pool = None  # one memory pool shared by this runner's live graphs

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def run(self, bucket: int, inputs: Optional[Sequence[torch.Tensor]], flat: Optional[torch.Tensor] = None,
            head: Optional[torch.Tensor] = None) -> list:
        """Replay `bucket`'s graph on `inputs` (each padded to the bucket, or only its live rows: module
        docstring), capturing it first when needed. `flat` instead of `inputs`: one host tensor of every input's
        elements in order, for a graph whose inputs are all index inputs: copied into the input buffer as it
        is. `head`: a device tensor copied over the first elements of the first input after that (values the
        device made, never waited for on the host)."""
        version = self.version()
        g = self._graphs.get(bucket)
        if g is None or g.version != version:
            self._drop_stale(version)
            g = self._capture(bucket, version)
        if flat is not None:
            if len(g.joined) != len(g.inputs) or flat.numel() != g.flat.numel() or flat.dtype != g.flat.dtype:
                raise ValueError(f"flat inputs of {flat.numel()} {flat.dtype} elements for a graph whose inputs are "
                                 + (f"{g.flat.numel()} {g.flat.dtype}" if len(g.joined) == len(g.inputs)
                                    else "not one buffer"))
            g.flat.copy_(flat, non_blocking=True)
        else:
            self._copy_in(g, inputs, bucket)
        if head is not None:
            g.inputs[0][:head.shape[0]].copy_(head)
        g.graph.replay()
        self.counters.replays += 1
        return g.outputs

    @staticmethod
    def _copy_in(g: _Captured, inputs: Sequence[torch.Tensor], bucket: int) -> None:
        """`inputs` into the static buffers, padded as the module docstring says. Index inputs on the host go in
        one host-to-device copy (with their padding rows, made on the host): on a GPU host each copy costs about
        as much host time as a kernel launch, and a small step is host-bound."""
        joined = g.joined if all(inputs[i].device.type == "cpu" for i in g.joined) else ()
        pieces = []
        for i, (buf, x) in enumerate(zip(g.inputs, inputs)):
            m = x.shape[0]
            if i in joined:
                pieces.append(x.reshape(-1))
                if m < bucket:
                    pieces.append(g.host_blank[i][m:].reshape(-1))
            elif m == bucket:
                buf.copy_(x, non_blocking=True)
            else:
                buf[:m].copy_(x, non_blocking=True)
                if buf.dtype == torch.long:  # an index input's padding rows: blank (a payload's keep theirs)
                    buf[m:].copy_(g.blank[i][m:])
        if pieces:
            g.flat.copy_(torch.cat(pieces) if len(pieces) > 1 else pieces[0], non_blocking=True)

    def _drop_stale(self, version: int) -> None:
        """Graphs of an older storage version point at freed storage: never replay them."""
        for b in [b for b, g in self._graphs.items() if g.version != version]:
            del self._graphs[b]

    def _capture(self, bucket: int, version: int) -> _Captured:
        blank = self.blank(bucket)
        inputs, flat, joined = _static_inputs(blank)
        graph, outputs = self._record(inputs)
        self.counters.captures += 1
        if bucket in self._ever:
            self.counters.recaptures += 1
        self._ever.add(bucket)
        g = _Captured(graph, inputs, list(outputs), version, flat, joined,
                      tuple(b if i in joined else None for i, b in enumerate(blank)),  # (only index rows are read)
                      {i: blank[i].cpu() for i in joined})
        self._graphs[bucket] = g
        return g

    def _record(self, inputs: list) -> tuple:
        """The method on the static `inputs`, warmed up and captured: -> (CUDA graph, its static outputs)."""
        if not self._graphs:  # a pool dies with its last graph; torch refuses to capture into a dead one
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy inits and Triton compiles happen outside the capture
            self.call(inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Python's cyclic GC must not run during the capture: collecting a dropped engine destroys its CUDA
        # graphs, and destroying a graph while another stream captures invalidates that capture.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")  # a host sync in the method is a bug: fail loudly
                try:
                    outputs = self.call(inputs)
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
        finally:
            if gc_was_enabled:
                gc.enable()
        return graph, outputs
