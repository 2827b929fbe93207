"""The model runner: the program's methods on one device, with this runner's own caches.

Owns what executing the artifact needs: the target KV cache (and the draft
cache when the engine speculates), the op table that binds the program's
`mg::` ops to those caches (passed to every `Program.run`, so several runners
can share one loaded program), packing of a scheduled step into the target
`forward`'s inputs, and one call path for every method:

    pad the leading dimension to its bucket -> admit the step in its cache ->
    replay a CUDA graph, or run the method eagerly -> cut outputs to live rows

"Run the method" is its compiled fused code when the run config compiles
(`compiled.py`; compiled once per program and device in a process, shared by
every runner), else the program interpreter.

With a hidden sink (`set_hidden_sink`: a DFlash engine's buffer of context rows waiting for the
drafter), the target `forward` also writes each row's hidden state to the buffer row the step names
(`StepBatch.hidden_dst`; a scratch row for rows that commit nothing), inside the same CUDA graph, so a
plain step's context commit costs the host no call of its own.

Padding rows come from each method's blank inputs (the scratch slot at
position 0; anchors at 0 for `draft_block`), so they never change a live
sequence. Buckets are 1, 2, 4, ... up to the method's bound (`cuda_graphs.py`).
`measure` times a method per bucket on blank inputs, through the same path:
the cost table adaptive speculation decides from.

Knows the artifact contract, the caches' protocol and the program API; knows
nothing of requests' sampling, acceptance or scheduling policy. Never imports
mg.export. See docs/ARCHITECTURE.md section 6.
"""

from __future__ import annotations

import contextlib
from array import array
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from mg.kernels import linear, ops as mg_ops, quant
from mg.kernels.precision import cuda_fp32_matmuls
from mg.manifests import constants as C

from .artifact import Artifact
from .cache_base import KVCache, make_cache
from .compiled import CompiledMethod, CompileStats, MethodCompiler
from .config import RunConfig
from .cuda_graphs import GraphCounters, GraphRunner, bucket_for, buckets, triton_enabled
from .draft_ops import DraftOps
from .program_ops import MM

log = logging.getLogger("mg.runtime")


@dataclass(frozen=True)
class PackedStep:
    """A step's `forward` inputs as `ModelRunner.pack` makes them: `columns`, lists of ints, hold the tokens,
    positions, slots, logits rows and (with a hidden sink) destinations, each padded to `size`, the step's
    bucket, when calls are padded. The call path admits the positions and slots as they are and makes one host
    tensor of every column (and the admission's placement, for layouts that take it as an input: `flat`):
    with CUDA graphs, one copy into the graph's input buffer. On a GPU serving a small model the host's calls
    are the step."""

    columns: tuple
    size: Optional[int]

    @property
    def positions(self) -> list:
        return self.columns[1]

    @property
    def slots(self) -> list:
        return self.columns[2]

    def flat(self, *extra: list) -> tuple[torch.Tensor, tuple[int, ...]]:
        """(one host int64 tensor of the columns and then `extra`, in order; each one's length)."""
        columns = (*self.columns, *extra)
        return long_tensor(*columns), tuple(map(len, columns))

    def inputs(self) -> list:
        """The columns as tensors (views of one)."""
        flat, lengths = self.flat()
        return list(flat.split(lengths))


class StepBatch:
    """One target `forward` step, packed: decode sequences' verify rows first, then prefill chunks.

    `tokens`, `positions`, `seq_slots` [N] and `logits_rows` [R] (rows that go through the LM head) are int64
    host tensors of the live rows; `groups`: (seq, first logits row, rows, first step row) per sampled group.
    Draft rows: `tokens[draft_rows] = draft_tokens.flatten()[draft_src]`, filled on the drafts' device.
    `hidden_dst` [N]: each row's row of the hidden sink (with one). `head_tokens` (a device tensor [m], or None):
    the tokens of the first m rows, made on the device by the step before (an overlapped step, `engine.py`);
    the packed tokens hold placeholders there. A step from `ModelRunner.pack` carries its
    `packed` inputs, and its tensors are views of them, made only when asked for; one built by hand
    (`StepBatch(tokens, positions, seq_slots, logits_rows)`) has none."""

    def __init__(self, tokens: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
                 logits_rows: torch.Tensor, groups: Optional[list] = None):
        self.n, self.r = tokens.shape[0], logits_rows.shape[0]
        self._live: Optional[list] = [tokens, positions, seq_slots, logits_rows, None]
        self.groups = groups if groups is not None else []
        self.draft_tokens: Optional[torch.Tensor] = None
        self.draft_rows: Optional[torch.Tensor] = None
        self.draft_src: Optional[torch.Tensor] = None
        self.head_tokens: Optional[torch.Tensor] = None
        self.packed: Optional[PackedStep] = None

    @classmethod
    def of_packed(cls, packed: PackedStep, n: int, r: int, groups: list, hidden_dst: bool) -> "StepBatch":
        """A step of `packed` inputs: n live rows, r logits rows; `hidden_dst`: its destinations are the step's
        (not all the scratch row)."""
        step = cls.__new__(cls)
        step.n, step.r, step._live, step.groups, step.packed = n, r, None, groups, packed
        step.draft_tokens = step.draft_rows = step.draft_src = step.head_tokens = None
        step._has_dst = hidden_dst
        return step

    def _columns(self) -> list:
        if self._live is None:
            n, r, views = self.n, self.r, self.packed.inputs()
            dst = views[4][:n] if len(views) > 4 and self._has_dst else None
            self._live = [views[0][:n], views[1][:n], views[2][:n], views[3][:r], dst]
        return self._live

    tokens = property(lambda self: self._columns()[0])
    positions = property(lambda self: self._columns()[1])
    seq_slots = property(lambda self: self._columns()[2])
    logits_rows = property(lambda self: self._columns()[3])

    @property
    def hidden_dst(self) -> Optional[torch.Tensor]:
        return self._columns()[4]

    @hidden_dst.setter
    def hidden_dst(self, value: Optional[torch.Tensor]) -> None:
        self._columns()[4] = value


@dataclass(frozen=True)
class HiddenSink:
    """Where the target `forward` writes its hidden rows itself: row i of a step goes to row
    `StepBatch.hidden_dst[i]` of `buffer()` (the buffer as it is at the call; `scratch` for rows that commit
    nothing, padding included). `version()` changes when the buffer moves: graphs that wrote to the old one
    are captured again."""

    buffer: Callable[[], torch.Tensor]
    version: Callable[[], int]
    scratch: int


@dataclass(frozen=True)
class _Plan:
    """How one method is padded, admitted and cut."""

    name: str
    limit: int  # the largest leading dimension a call may have
    blank: Callable[[int], list]  # padding-only inputs of `size` rows (index tensors on the host)
    cache: Optional[KVCache]  # declare_step(inputs[1], inputs[2]) before the call; None: no admission
    cut: Callable[[list, list], list]  # (outputs, live row counts) -> outputs of the live rows


class ModelRunner:
    """Runs the artifact's methods for one engine; see the module docstring."""

    def __init__(self, artifact: Artifact, config: RunConfig, with_draft: bool):
        self.artifact = artifact
        self.config = config
        self.device = torch.device(config.device)
        self.program = artifact.program
        if config.prefer_cublaslt:
            _prefer_cublaslt()
        kv = artifact.manifest.kv
        self.cache = make_cache(kv, self.device, config.n_slots if config.n_slots is not None else kv.max_active_seqs)
        if config.use_triton is not None:
            self.cache.use_triton = triton_enabled(self.device, config.use_triton)
        self.cache.row_invariant = config.row_invariant_attention  # the CPU read side (mg.kernels.cpu_attention)
        self.counters = GraphCounters()
        self.ops: dict[str, Callable] = {_qualified(mg_ops.UPDATE_AND_ATTEND): self.cache.update_and_attend,
                                         **quant.kernels(self.device, config.int4_tensor_cores)}
        if config.row_invariant_mm:  # the program's float matrix products, row-invariant (RunConfig.row_invariant)
            self.ops[MM] = linear.op()
        elif config.rows_mm:  # few float32 rows on CUDA cores (RunConfig.rows_kernel)
            self.ops[MM] = linear.rows_op()
        self._plans = {C.METHOD_FORWARD: _Plan(C.METHOD_FORWARD, kv.max_write, self._blank_forward, self.cache,
                                               _cut_forward)}
        self.draft_cache: Optional[KVCache] = None
        if with_draft:
            draft = artifact.manifest.draft
            self.block_size, self.mask_token = draft.block_size, draft.mask_token_id
            draft_slots = self.cache.n_slots if draft.kv.layout == C.LAYOUT_CELL else None
            self.draft_cache = make_cache(draft.kv, self.device, draft_slots)
            if config.use_triton is not None:  # draft ops write through the cache's kernels
                self.draft_cache.use_triton = triton_enabled(self.device, config.use_triton)
            draft_ops = DraftOps(self.draft_cache)
            self.ops.update({_qualified(mg_ops.DRAFT_APPEND): draft_ops.append,
                             _qualified(mg_ops.DRAFT_ATTEND): draft_ops.attend})
            self._hidden_spec = artifact.manifest.method(C.METHOD_DRAFT_APPEND).inputs[0]
            self._plans[C.METHOD_DRAFT_BLOCK] = _Plan(C.METHOD_DRAFT_BLOCK, draft.kv.max_active_seqs,
                                                      self._blank_block, None, _cut_rows)
            self._plans[C.METHOD_DRAFT_APPEND] = _Plan(C.METHOD_DRAFT_APPEND, draft.kv.max_write,
                                                       self._blank_append, self.draft_cache, lambda out, live: out)
        if config.reserved:
            self._reserve_caches()
        self._compiled: dict[str, CompiledMethod] = {}
        self.compile_stats: Optional[CompileStats] = None
        if config.compiled:
            self._compiled, self.compile_stats = _compiled_methods(artifact, self.device, self._plans, self.ops,
                                                                   one_row=not config.row_invariant_mm)
        self._sink: Optional[HiddenSink] = None
        # Methods whose calls write their admission's placement themselves (layouts with a placement input: the
        # cell table), from one more input column, inside the call's graph: no copy and launch of its own.
        self._placing = {name for name, plan in self._plans.items()
                         if plan.cache is not None and plan.cache.placement_input}
        self._graphs: dict[str, GraphRunner] = {}
        if config.graphs:
            for name, plan in self._plans.items():
                cache = self.draft_cache if name != C.METHOD_FORWARD else self.cache
                version = self._forward_version if name == C.METHOD_FORWARD else cache.storage_version
                self._graphs[name] = GraphRunner(self._eager_call(name), self._device_blank(plan), version,
                                                 self.counters)
        self._blanks: dict[tuple[str, int], list] = {}
        # Methods whose fp32 matrix products run in TF32 (eagerly and as captured in graphs): the drafter's.
        self._tf32_methods = ({C.METHOD_DRAFT_BLOCK, C.METHOD_DRAFT_APPEND} if with_draft and config.drafter_tf32
                              else set())
        self.call_log: Optional[list] = None  # a list: every call appends (method, live rows, seconds)

    def _reserve_caches(self) -> None:
        """KV storage at its declared size before any graph is captured (RunConfig.reserve_kv); without the
        memory for it, said in one line, storage grows as contexts grow (each growth captures graphs again)."""
        for cache in (self.cache, self.draft_cache):
            if cache is None:
                continue
            try:
                cache.reserve()
            except torch.OutOfMemoryError:
                log.warning(f"mg-run: not enough {self.device} memory to allocate the {cache.layout} KV cache "
                            f"whole ({cache.capacity} positions); it grows as contexts grow, and CUDA graphs are "
                            f"captured again after each growth")

    def set_hidden_sink(self, sink: HiddenSink) -> None:
        """From now on `forward` writes hidden rows to `sink` (module docstring). Before the first forward call:
        its blank inputs and graphs take the sink's input."""
        if self._blanks or any(g.captured for g in self._graphs.values()):
            raise RuntimeError("set_hidden_sink after calls were made: blank inputs and graphs would disagree")
        self._sink = sink

    def _forward_version(self):
        """What the forward's graphs depend on: the KV storage, and the hidden sink's buffer."""
        return self.cache.storage_version(), self._sink.version() if self._sink is not None else 0

    # ------------------------------------------------------------------ methods

    def forward(self, batch: StepBatch) -> list:
        """The target `forward` of a packed step: [logits [R, V], hidden [N, taps*dim] (with a drafter)]."""
        n, r = batch.n, batch.r
        if batch.packed is not None and batch.draft_tokens is None:  # `pack`'s inputs as they are
            return self.call(C.METHOD_FORWARD, None, [r, n], batch.packed, batch.head_tokens)
        if batch.head_tokens is not None:
            raise ValueError("a step's tokens from the device (head_tokens) go with packed inputs and no drafts")
        if batch.packed is not None:  # its inputs as tensors (padded when calls are), tokens filled in below
            inputs = batch.packed.inputs()
        else:  # a StepBatch built by hand: its live rows
            inputs = [batch.tokens, batch.positions, batch.seq_slots, batch.logits_rows]
            if self._sink is not None:  # rows without a destination commit nothing: the scratch row
                inputs.append(batch.hidden_dst if batch.hidden_dst is not None
                              else torch.full((n,), self._sink.scratch, dtype=torch.long))
        if batch.draft_tokens is not None:  # drafts stay where they were made: no wait for them on the host
            tokens = inputs[0]
            dev, m, k = batch.draft_tokens.device, tokens.shape[0], batch.draft_rows.shape[0]
            tokens, rows, src = to_device(torch.cat([tokens, batch.draft_rows, batch.draft_src]), dev).split([m, k, k])
            # In place into the concatenation above (a new tensor), never into the step's tokens.
            inputs[0] = tokens.index_copy_(0, rows, batch.draft_tokens.flatten().index_select(0, src))
        return self.call(C.METHOD_FORWARD, inputs, [r, n])

    def draft_block(self, tokens: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor) -> torch.Tensor:
        """Proposal logits [B, T-1, V] for blocks tokens [B, T] anchored at positions[:, 0]."""
        return self.call(C.METHOD_DRAFT_BLOCK, [tokens, positions, seq_slots], [tokens.shape[0]])[0]

    def draft_append(self, hidden: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
                     spans: Optional[list[tuple[int, int, int]]] = None) -> None:
        """Append committed context rows to the draft cache, in calls of at most the method's bound. `spans`:
        the same rows as (slot, first position, rows), one per slot in row order, when the caller has them:
        each call admits its rows by span (`declare_spans`), not row by row."""
        limit = self._plans[C.METHOD_DRAFT_APPEND].limit
        for lo in range(0, hidden.shape[0], limit):
            hi = lo + limit
            self.call(C.METHOD_DRAFT_APPEND, [hidden[lo:hi], positions[lo:hi], seq_slots[lo:hi]], [],
                      spans=None if spans is None else _cut_spans(spans, lo, hi))

    def call(self, method: str, inputs: Optional[list], live: list[int], packed: Optional[PackedStep] = None,
             head: Optional[torch.Tensor] = None, spans: Optional[list[tuple[int, int, int]]] = None) -> list:
        """The one path of every method call: pad -> admit -> graph or eager -> cut (module docstring).
        `spans` (a method with a cache, `inputs` its live rows): those rows as (slot, first position, rows),
        admitted as spans (`declare_spans`; padding rows need no admission, so with CUDA graphs the call
        passes its live rows and the graph's input buffers pad them: `GraphRunner.run`).
        `packed` (the `forward` of `pack`, with `inputs` None): inputs made, padded and listed at once; with
        CUDA graphs they go to the graph's input buffer in one copy. `head` (with `packed`): a device tensor
        that replaces the first elements of the first input (tokens) once on the device. A method whose cache
        has a placement input (the cell layout: forward and draft_append) gets the admission's placement as
        one more input, written by the call itself."""
        plan = self._plans[method]
        t0 = time.perf_counter()
        placing = method in self._placing
        graphs = self._graphs.get(method)
        flat = None
        if packed is not None:
            size = packed.size
            # Padding rows too: the host admits them, outside graphs.
            placement = plan.cache.declare_rows(packed.positions, packed.slots, defer=placing)
            flat, lengths = packed.flat(placement) if placing else packed.flat()
        else:
            rows = max(x.shape[0] for x in inputs)
            size = bucket_for(rows, plan.limit) if self.config.padded else None
            # Padded here unless a graph pads them and no padding row needs admission (row by row admits them).
            short = size is not None and any(x.shape[0] != size for x in inputs)
            if short and (graphs is None or (plan.cache is not None and spans is None)):
                inputs = [x if x.shape[0] == size else torch.cat([x, to_device(b[x.shape[0]:], x.device)])
                          for x, b in zip(inputs, self._blank(plan, size))]
            if spans is not None:
                placement = plan.cache.declare_spans(spans, defer=placing)
                if placing and inputs[0].shape[0] > len(placement):  # padded above: the scratch cell
                    placement += [plan.cache.scratch_cell] * (inputs[0].shape[0] - len(placement))
            elif plan.cache is not None:  # padding rows too, as above
                placement = plan.cache.declare_step(inputs[1], inputs[2], defer=placing)
            if placing:
                inputs = [*inputs, long_tensor(placement)]
        if size is not None and graphs is not None:
            out = graphs.run(size, inputs, flat, head)
        else:
            if flat is None:
                inputs = [to_device(x, self.device) for x in inputs]
            else:  # one host-to-device copy (none on CPU), then its views
                inputs = list(to_device(flat, self.device).split(lengths))
                if head is not None:  # (on CPU into this call's own host tensor: `flat` makes one per call)
                    inputs[0][:head.shape[0]] = head
            out = self._run(method, inputs, size is not None, extras=True)
        if self.call_log is not None:
            self.call_log.append((method, live[-1] if live else rows, time.perf_counter() - t0))  # live rows
        return out if size is None else plan.cut(out, live)

    def warm_up(self) -> None:
        """Capture every bucket of every method now (with CUDA graphs; nothing to do without), on blank inputs,
        so that no capture lands inside a timed or latency-sensitive step later."""
        if not self._graphs:
            return
        for method, plan in self._plans.items():
            for size in buckets(plan.limit):
                self.call(method, self._blank(plan, size), [size, size])

    def captured(self, method: str) -> tuple[int, ...]:
        """Buckets of `method` that have a live CUDA graph now (empty without graphs)."""
        g = self._graphs.get(method)
        return g.captured if g is not None else ()

    # ------------------------------------------------------------------ packing

    def pack(self, decode: list, ks: list[int], prefill: list, draft_tokens: Optional[torch.Tensor] = None,
             hidden_dst: Optional[list[int]] = None, head_tokens: Optional[torch.Tensor] = None) -> StepBatch:
        """Decode sequences write their pending token and `ks[i]` drafts (row i of `draft_tokens` [len(decode),
        width], filled in where the drafts live; every row gets logits: the verify rows), then prefill chunks
        (the last row gets logits when the chunk ends the prompt). `hidden_dst`: each row's row of the hidden
        sink, in that order. The forward's inputs are made here at once (`PackedStep`), padded to the step's
        bucket as the forward's blank inputs pad (scratch slot, position 0, logits of row 0) when calls are
        padded. `head_tokens` (a device tensor, one per decode sequence; no drafts): the decode rows' tokens,
        made on the device by an overlapped step whose tokens the host has not read yet (`engine.py`); the
        sequences' last known tokens stand in the packed column."""
        tokens, positions, slots, rows, groups = [], [], [], [], []
        draft_rows, draft_src = [], []
        width = draft_tokens.shape[1] if draft_tokens is not None else 0
        for i, (seq, k) in enumerate(zip(decode, ks)):
            start, first = seq.n_cached, len(tokens)
            if k:
                tokens += [seq.tokens[-1]] + [0] * k
                draft_rows += range(first + 1, first + 1 + k)
                draft_src += range(i * width, i * width + k)
                positions += range(start, start + 1 + k)
                slots += [seq.slot] * (1 + k)
                rows += range(first, first + 1 + k)
            else:  # a plain step's row (the common case)
                tokens.append(seq.tokens[-1])
                positions.append(start)
                slots.append(seq.slot)
                rows.append(first)
            groups.append((seq, first, 1 + k, first))
        for chunk in prefill:
            seq, first = chunk.seq, len(tokens)
            tokens += seq.tokens[chunk.start:chunk.start + chunk.length]
            positions += range(chunk.start, chunk.start + chunk.length)
            slots += [seq.slot] * chunk.length
            if chunk.wants_logits:
                groups.append((seq, len(rows), 1, first + chunk.length - 1))
                rows.append(len(tokens) - 1)
        n, r = len(tokens), len(rows)
        sink = self._sink
        dst = None if sink is None else hidden_dst if hidden_dst is not None else [sink.scratch] * n
        size = bucket_for(n, self._plans[C.METHOD_FORWARD].limit) if self.config.padded else None
        if size is not None:  # the forward's padding rows
            pad = size - n
            token, position, slot, row = self._blank_forward_row()
            if pad:
                tokens += [token] * pad
                positions += [position] * pad
                slots += [slot] * pad
                if dst is not None:
                    dst = dst + [sink.scratch] * pad
            rows += [row] * (size - r)  # fewer logits rows than rows (prompt chunks): padded even when n fills it
        columns = (tokens, positions, slots, rows) if dst is None else (tokens, positions, slots, rows, dst)
        step = StepBatch.of_packed(PackedStep(columns, size), n, r, groups, hidden_dst is not None)
        if draft_rows:
            step.draft_tokens, step.draft_rows, step.draft_src = draft_tokens, long_tensor(draft_rows), long_tensor(draft_src)
        if head_tokens is not None:
            if draft_rows or head_tokens.shape[0] != len(decode):
                raise ValueError(f"head_tokens has {head_tokens.shape[0]} tokens for {len(decode)} decode sequences "
                                 f"and {len(draft_rows)} draft rows; allowed: one per sequence, no drafts")
            step.head_tokens = head_tokens
        return step

    # ------------------------------------------------------------------ costs

    def measure(self, method: str, reps: int = 3) -> dict[int, float]:
        """Seconds per call of `method` at each bucket of its leading dimension, on blank inputs (scratch
        slot, position 0: nothing live changes), through `call` (see `time_buckets`)."""
        plan = self._plans[method]
        return time_buckets(self.device, buckets(plan.limit),
                            lambda size: self.call(method, self._blank(plan, size), [size, size]), reps)

    # ------------------------------------------------------------------ blanks

    def _blank(self, plan: _Plan, size: int) -> list:
        key = (plan.name, size)
        if key not in self._blanks:
            self._blanks[key] = self._call_blank(plan, size)
        return self._blanks[key]

    def _call_blank(self, plan: _Plan, size: int) -> list:
        """A call's blank inputs: the method's, and for `forward` with a hidden sink its destinations (all the
        scratch row)."""
        blank = plan.blank(size)
        if plan.name == C.METHOD_FORWARD and self._sink is not None:
            blank = [*blank, torch.full((size,), self._sink.scratch, dtype=torch.long)]
        return blank

    def _device_blank(self, plan: _Plan) -> Callable[[int], list]:
        """A graph's blank inputs: a call's, and for a method whose cache has a placement input the padding
        rows' placement (the scratch cell), which `call` adds after admission."""
        def blank(size: int) -> list:
            inputs = self._call_blank(plan, size)
            if plan.name in self._placing:
                inputs.append(torch.full((size,), plan.cache.scratch_cell, dtype=torch.long))
            return [x.to(self.device) for x in inputs]
        return blank

    def _eager_call(self, method: str) -> Callable[[list], list]:
        return lambda inputs: self._run(method, inputs, True, extras=True)

    @property
    def plans(self) -> dict:
        """Per method: its bound on the leading dimension (`limit`), blank inputs and cache (read only)."""
        return self._plans

    def run_method(self, method: str, inputs: list) -> list:
        """`method` once on device inputs of one bucket, no padding, admission or graph: its compiled code
        when the config compiles, else the interpreter. For callers that capture several methods in one
        graph (`fused_round.py`); they admit the rows in the caches themselves."""
        return self._run(method, inputs, True)

    def _run(self, method: str, inputs: list, padded: bool, extras: bool = False) -> list:
        """The method once, without graphs. `extras`: the inputs end with what the call path adds to the
        method's own (`call`): a forward's hidden sink destinations, then the placement where the method's
        cache takes one; the placement is written to the cache first, and the hidden rows to the sink after."""
        dst = placement = None
        if extras:
            if method in self._placing:
                inputs, placement = inputs[:-1], inputs[-1]
            if method == C.METHOD_FORWARD and self._sink is not None:
                inputs, dst = inputs[:-1], inputs[-1]
        if placement is not None:
            self._plans[method].cache.place(inputs[1], inputs[2], placement)
        out = self._execute(method, inputs, padded)
        if dst is not None:
            self._sink.buffer().index_copy_(0, dst, out[1])
        return out

    def _execute(self, method: str, inputs: list, padded: bool) -> list:
        """The method's own inputs through its compiled code (padded calls: every input one bucket long), else
        the interpreter."""
        compiled = self._compiled.get(method) if padded else None
        with _tf32_matmuls(method in self._tf32_methods):
            if compiled is not None:
                return compiled(inputs, self.ops)
            return self.program.run(method, inputs, ops=self.ops)

    @property
    def hidden_width(self) -> int:
        """Width of the hidden rows `forward` hands the drafter (taps x dim); with a drafter only."""
        return self._hidden_spec.shape[1]

    @property
    def hidden_dtype(self) -> torch.dtype:
        return getattr(torch, self._hidden_spec.dtype)

    @property
    def compiled_methods(self) -> tuple[str, ...]:
        """Methods that run as compiled code (empty when the config does not compile)."""
        return tuple(self._compiled)

    def _blank_forward_row(self) -> tuple[int, int, int, int]:
        """A padding row of `forward` (token, position, slot, logits row): the scratch slot at position 0, logits
        of row 0. `pack` pads with it, and the blank inputs are made of it."""
        return 0, 0, self.cache.scratch_slot, 0

    def _blank_forward(self, size: int) -> list:
        """`size` padding rows (`_blank_forward_row`)."""
        return [torch.full((size,), x, dtype=torch.long) for x in self._blank_forward_row()]

    def _blank_block(self, size: int) -> list:
        """`size` blocks anchored at 0 on the draft scratch slot: they read no context and write nothing."""
        t = self.block_size
        return [torch.full((size, t), self.mask_token, dtype=torch.long), torch.arange(t).repeat(size, 1),
                torch.full((size,), self.draft_cache.scratch_slot, dtype=torch.long)]

    def _blank_append(self, size: int) -> list:
        """`size` context rows written to the draft scratch slot at position 0 (hidden on the device)."""
        hidden = torch.zeros(size, self.hidden_width, dtype=self.hidden_dtype, device=self.device)
        zeros = torch.zeros(size, dtype=torch.long)
        return [hidden, zeros, torch.full_like(zeros, self.draft_cache.scratch_slot)]


# Compiled methods per loaded program, device and matrix product: every runner on one program shares them (their op
# tables are passed per call), and they go with the program.
_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _cut_spans(spans: list[tuple[int, int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The part of `spans` (slot, first position, rows; in row order) that covers rows lo..hi-1."""
    out, at = [], 0
    for slot, first, m in spans:
        a, b = max(lo, at), min(hi, at + m)
        if a < b:
            out.append((slot, first + a - at, b - a))
        at += m
    return out


def _compiled_methods(artifact: Artifact, device: torch.device, plans: dict, table: dict, one_row: bool = True):
    """The compiled methods of `plans` (compiling those not compiled yet for this program and device; a method
    that failed to compile stays interpreted) and the compile stats of this program and device. `one_row=False`
    (row-invariant products): only the symbolic variant, for calls of every size (`MethodCompiler.compile`)."""
    per_device = _COMPILED.setdefault(artifact.program, {})
    # The code traced depends on what serves the matrix products; the variants kept, on one_row.
    key = f"{device} {table.get(MM, MM)} {'1+n' if one_row else 'n'}"
    if key not in per_device:
        sha = next((f.sha256 for f in artifact.manifest.files if f.name == C.PROGRAM_FILE), None)
        per_device[key] = (MethodCompiler(artifact.program, sha or "unhashed", device), {})
    compiler, methods = per_device[key]
    before = len(compiler.stats.events)
    for name, plan in plans.items():
        if name not in methods:
            methods[name] = compiler.compile(name, plan.blank, plan.limit, table, one_row=one_row)
    new = [e for e in compiler.stats.events[before:] if e[2] == "compiled"]
    if new:
        log.info(f"mg-run: compiled {len(new)} method variants in {sum(e[3] for e in new):.1f}s")
    return {name: methods[name] for name in plans if methods[name] is not None}, compiler.stats


@contextlib.contextmanager
def _tf32_matmuls(on: bool):
    """CUDA fp32 matrix products in TF32 inside the block when `on` (`RunConfig.draft_tf32`), untouched otherwise
    (`mg.kernels.precision`)."""
    if not on:
        yield
        return
    with cuda_fp32_matmuls(True):
        yield


def _prefer_cublaslt() -> None:
    """CUDA matrix products through cuBLASLt, for the whole process (RunConfig.cublaslt); said once."""
    if torch.backends.cuda.preferred_blas_library() != torch._C._BlasBackend.Cublaslt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        log.info("mg-run: CUDA matrix products go to cuBLASLt (process-wide)")


def time_buckets(device: torch.device, sizes, call: Callable[[int], object], reps: int = 3) -> dict[int, float]:
    """Seconds of `call(size)` per size. CPU: the fastest of `reps` calls; CUDA: the mean of `reps` calls
    between two synchronisations, after one warm-up call (lazy inits, graph capture). A size never costs less
    than a larger one's time says (from the top down: noise spikes are cut)."""
    out = {}
    for size in sizes:
        call(size)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                call(size)
            torch.cuda.synchronize(device)
            out[size] = (time.perf_counter() - t0) / reps
        else:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                call(size)
                times.append(time.perf_counter() - t0)
            out[size] = min(times)
    ordered = sorted(out)
    for small, large in zip(ordered[-2::-1], ordered[:0:-1]):
        out[small] = min(out[small], out[large])
    return out


def long_tensor(*lists: list) -> torch.Tensor:
    """One int64 host tensor of the concatenated lists of ints: `torch.tensor(list)` converts element by element
    (about 55 ns each); an array's buffer is one copy (a few times faster at a step's sizes)."""
    values = array("q")
    for xs in lists:
        values.extend(xs)
    return torch.frombuffer(values, dtype=torch.long) if values else torch.empty(0, dtype=torch.long)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`x` on `device`, the copy queued without waiting for the device (a host tensor is staged by the driver
    before this returns, so the caller may drop or reuse it at once)."""
    return x.to(device, non_blocking=True)


def _qualified(op: str) -> str:
    return f"{mg_ops.NAMESPACE}::{op}"


def _cut_forward(out: list, live: list[int]) -> list:
    r, n = live
    return [out[0][:r], *(o[:n] for o in out[1:])]


def _cut_rows(out: list, live: list[int]) -> list:
    return [o[:live[0]] for o in out]
