"""Compiled methods: a program method lifted into one FX graph, compiled by Inductor, cached on disk.

The interpreter (`program.py`) runs a method as ~1000 separate torch ops; on a GPU most of them are tiny
element-wise kernels (fp32 norms, RoPE, gates, soft cap) whose launches and memory round trips cost more
than the matrix products between them. Here the method is traced once, through the interpreter itself,
with `make_fx` on fake tensors: the result is an ATen FX graph of the same ops, with the `mg::` ops left as
opaque calls of the registered ops (`mg.kernels.ops`, served at run time by the caller's op table through
`serving`). The weights the graph reads become leading graph inputs (never copied, never part of the
compiled code). Inductor compiles the graph: fused Triton kernels on CUDA, C++ on CPU.

Two variants per method, both traced with every leading dimension equal (the model runner pads every
input of a call to one bucket): leading dimension 1 (static), and any other size (one symbolic size,
traced at an example size that no other input dimension has). A `CompiledMethod` picks by the call's size.

Cache (docs/ARCHITECTURE.md section 6.4): each variant's compiled code is saved with
`torch._inductor.standalone_compile(...).save` under `<cache root>/compiled/<model.pte sha256>/`, with a
JSON entry beside it: the key (format, program, method, variant and its traced size, device, torch, triton,
and a hash of the sources the traced graph depends on: the interpreter, its op table, this file and the
`mg::` schemas), the saved file's sha256, the traced graph's hash, and where each graph constant lives in
the program's loaded values. A later start with the same key takes the constants from there and loads the
saved code without tracing (or, when a constant could not be located, traces and loads the code if the
graph's hash matches). A key that differs in anything is said in one line and compiled again; a saved file
that does not match its recorded sha256 or fails to load is said in one line and compiled again. Loaded code
is kept per process by its sha256, so runners on a program loaded again share it. Compilation that fails
is said in one line naming the method, and the method stays interpreted.

Knows torch's tracing and Inductor APIs and the program API; nothing about MG models or caches.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from mg.kernels import linear, ops as mg_ops, quant
from mg.manifests.values import cache_root, write_cache_file

from .program import Program, first_line
from .program_ops import SERVABLE_ATEN

log = logging.getLogger("mg.runtime")

FORMAT = 1  # bump when what is saved, or how it is called, changes
# Compiled code loaded in this process, by the sha256 of its saved file: runners on programs loaded again
# (same program, same device) reuse it with their own constants.
_LOADED: dict[str, Callable] = {}


@functools.lru_cache(maxsize=None)
def _sources_hash() -> str:
    """What the traced graph depends on besides the program and torch: the interpreter, its op table, this
    tracing code and the `mg::` op schemas (attention, quantized linears, the float products of `mg.kernels.linear`)."""
    from . import program, program_ops

    h = hashlib.sha256()
    for module in (program, program_ops, sys.modules[__name__], mg_ops, quant, linear):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:32]


def registered_op(qualified: str):
    """The registered torch op of a custom op name ("mg::update_and_attend" -> torch.ops.mg.update_and_attend)."""
    ns, name = qualified.split("::", 1)
    return getattr(getattr(torch.ops, ns), name).default


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return f"{device.type} {platform.machine()}"


def _triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@dataclass
class _Variant:
    fn: Callable  # compiled: fn(*consts, *inputs) -> outputs
    consts: list  # the weights and folded constants the graph reads, in its input order


class CompiledMethod:
    """A method's compiled variants; `__call__(inputs, table)` runs the one for the inputs' leading size."""

    def __init__(self, one: Optional[_Variant], many: Optional[_Variant]):
        if one is None and many is None:
            raise ValueError("a compiled method needs at least one variant")
        self._one, self._many = one, many

    @property
    def variants(self) -> tuple[str, ...]:
        """The variants compiled: "1" (one row, static) and/or "n" (any leading size, symbolic)."""
        return tuple(name for name, v in (("1", self._one), ("n", self._many)) if v is not None)

    def __call__(self, inputs: list, table: Mapping[str, Callable]) -> list:
        v = self._one if inputs[0].shape[0] == 1 and self._one is not None else self._many
        with mg_ops.serving(table):
            return list(v.fn(*v.consts, *inputs))


@dataclass
class CompileStats:
    """What compiling a runner's methods cost, per variant: seconds traced, compiled or loaded, and how."""

    events: list  # (method, variant, "compiled" | "loaded" | "failed", seconds)


class MethodCompiler:
    """Compiles methods of one program for one device, through the disk cache (module docstring)."""

    def __init__(self, program: Program, program_sha256: str, device: torch.device,
                 cache_dir: Optional[Path] = None):
        self.program = program
        self.device = torch.device(device)
        self.cache_dir = (cache_dir or cache_root() / "compiled") / program_sha256[:32]
        self.stats = CompileStats([])
        self._env = {"format": FORMAT, "program": program_sha256, "device": device_description(self.device),
                     "torch": torch.__version__, "triton": _triton_version(), "sources": _sources_hash()}

    def compile(self, method: str, blank: Callable[[int], list], limit: int,
                table: Mapping[str, Callable], one_row: bool = True) -> Optional[CompiledMethod]:
        """The compiled method, or None (said in one line) when it cannot be compiled. `blank(size)` gives
        padding inputs of `size` rows (as the runner pads); `limit` is the largest leading size; `table`
        names the custom ops (their callables are not called while compiling). `one_row=False`: no static
        one-row variant where the symbolic one exists (limit >= 2); every call runs the same code, so a row
        is reduced by the same kernels, launched alike, whatever the call's size (row-invariant serving:
        docs/ARCHITECTURE.md section 6.4)."""
        try:
            one = many = None
            if one_row or limit < 2:
                one = self._variant(method, "1", blank(1), table)
            if limit >= 2:
                many = self._variant(method, "n", blank(self._example_size(blank, limit)), table)
        except Exception as e:  # tracing or Inductor failed: the interpreter still runs the method
            self.stats.events.append((method, "-", "failed", 0.0))
            log.warning(f"mg-run: compiling method {method!r} failed ({type(e).__name__}: {first_line(e)}); "
                        f"it runs interpreted")
            return None
        return CompiledMethod(one, many)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _example_size(blank: Callable[[int], list], limit: int) -> int:
        """A leading size to trace the symbolic variant at: >= 2 (1 would be specialised), and equal to no
        other dimension of the inputs (equal sizes would be taken as one symbol)."""
        others = {d for x in blank(2) for d in x.shape[1:]}
        for n in range(3, limit + 1):
            if n not in others:
                return n
        return 2

    def _variant(self, method: str, variant: str, inputs: list, table: Mapping[str, Callable]) -> _Variant:
        t0 = time.perf_counter()
        # On the compiler's device (blank inputs are host tensors), distinct tensors: one graph input each.
        # Tracing and Inductor both see these: example inputs on another device than the weights fail there.
        inputs = [x.to(self.device).clone() for x in inputs]
        key = dict(self._env, method=method, variant=variant, rows=int(inputs[0].shape[0]),
                   served=sorted(f"{name}={table[name]}" for name in SERVABLE_ATEN if name in table))
        stem = self.cache_dir / f"{method}-{variant}"
        entry = self._entry(stem, key)
        if entry is not None and entry.get("constants") is not None:  # warm: no tracing at all
            consts = self._resolve(method, entry["constants"])
            fn = self._load(entry) if consts is not None else None
            if fn is not None:
                self.stats.events.append((method, variant, "loaded", time.perf_counter() - t0))
                return _Variant(fn, consts)
        gm, consts = self.trace(method, variant, inputs, table)
        graph = _graph_hash(gm, consts)
        if entry is not None and entry.get("graph") == graph:
            fn = self._load(entry)
            if fn is not None:
                self.stats.events.append((method, variant, "loaded", time.perf_counter() - t0))
                return _Variant(fn, consts)
        _fake_constants(gm, consts)
        if not any(what == "compiled" for _, _, what, _ in self.stats.events):
            log.info(f"mg-run: compiling the program's methods for {self._env['device']} (once per program, device "
                     f"and torch version; kept under {self.cache_dir})")
        compiled = torch._inductor.standalone_compile(gm, [*consts, *inputs], dynamic_shapes="from_graph")
        self._save(stem, key, compiled, graph, self._locate(method, consts))
        self.stats.events.append((method, variant, "compiled", time.perf_counter() - t0))
        return _Variant(compiled, consts)

    def trace(self, method: str, variant: str, inputs: list, table: Mapping[str, Callable]):
        """The method as an ATen graph (fake tensors; the symbolic variant with one size symbol), its tensor
        constants lifted to leading inputs: (graph module, constants)."""
        from torch.fx.experimental.proxy_tensor import make_fx

        # mg:: ops as their registered ops; aten ops the table serves (`SERVABLE_ATEN`) by the registered op it names
        trace_ops = {name: fn if name in SERVABLE_ATEN else registered_op(name) for name, fn in table.items()}
        gm = make_fx(lambda *xs: self.program.run(method, list(xs), ops=trace_ops),
                     tracing_mode="symbolic" if variant == "n" else "fake", _allow_non_fake_inputs=True)(*inputs)
        return gm, _lift_constants(gm)

    def _locate(self, method: str, consts: list) -> Optional[list]:
        """Where each constant lives in the method's loaded values: [value index, list item or -1], so a later
        start finds them without tracing; None when one is not there (then every start traces)."""
        where: dict[int, list] = {}
        for i, v in enumerate(self.program.loaded_values(method)):
            if isinstance(v, torch.Tensor):
                where.setdefault(id(v), [i, -1])
            elif isinstance(v, list):
                for j, item in enumerate(v):
                    if isinstance(item, torch.Tensor):
                        where.setdefault(id(item), [i, j])
        found = [where.get(id(c)) for c in consts]
        return None if any(f is None for f in found) else found

    def _resolve(self, method: str, locators: list) -> Optional[list]:
        values = self.program.loaded_values(method)
        try:
            consts = [values[i] if j < 0 else values[i][j] for i, j in locators]
        except (IndexError, TypeError, ValueError):
            return None
        return consts if all(isinstance(c, torch.Tensor) for c in consts) else None

    def _entry(self, stem: Path, key: dict) -> Optional[dict]:
        """The cache entry for `key` with its `.bin` bytes checked, or None (said in one line when an entry is
        there but stale, corrupt or unreadable)."""
        meta_path, bin_path = stem.with_suffix(".json"), stem.with_suffix(".bin")
        if not meta_path.exists():
            return None
        what = f"compile cache {bin_path}"
        try:
            meta = json.loads(meta_path.read_text(encoding="ascii"))
            saved_key, digest = meta["key"], meta["sha256"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning(f"mg-run: {what}: unreadable key ({type(e).__name__}); compiling again")
            return None
        if saved_key != key:
            diff = sorted(k for k in set(key) | set(saved_key) if saved_key.get(k) != key.get(k))
            log.warning(f"mg-run: {what} was built for another {', '.join(diff)} "
                        f"({', '.join(f'{saved_key.get(k)} != {key.get(k)}' for k in diff[:2])}); compiling again")
            return None
        try:
            data = bin_path.read_bytes()
        except OSError as e:
            log.warning(f"mg-run: {what}: unreadable ({e.strerror}); compiling again")
            return None
        if hashlib.sha256(data).hexdigest() != digest:
            log.warning(f"mg-run: {what} does not match its recorded sha256 (corrupt); compiling again")
            return None
        return dict(meta, path=str(bin_path))

    def _load(self, entry: dict) -> Optional[Callable]:
        """The entry's compiled code; loaded once per process (keyed by the file's sha256)."""
        fn = _LOADED.get(entry["sha256"])
        if fn is None:
            try:
                fn = torch._inductor.CompiledArtifact.load(path=entry["path"], format="binary")
            except Exception as e:  # a damaged or foreign file fails in many ways
                log.warning(f"mg-run: compile cache {entry['path']} failed to load ({type(e).__name__}); "
                            f"compiling again")
                return None
            _LOADED[entry["sha256"]] = fn
        return fn

    def _save(self, stem: Path, key: dict, compiled, graph: str, constants: Optional[list]) -> None:
        """Best effort: an unwritable cache folder costs a compile next time, nothing else."""
        bin_path = stem.with_suffix(".bin")
        tmp = bin_path.with_name(f"{bin_path.name}.{os.getpid()}.tmp")
        try:
            bin_path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save(path=str(tmp), format="binary")
            digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
            tmp.replace(bin_path)
        except Exception:  # OSError, or a compiled artifact that cannot be serialised
            tmp.unlink(missing_ok=True)
            return
        _LOADED[digest] = compiled
        write_cache_file(stem.with_suffix(".json"), json.dumps(
            {"key": key, "sha256": digest, "graph": graph, "constants": constants}))


def _lift_constants(gm: torch.fx.GraphModule) -> list:
    """Turn the graph's tensor constants (the weights the interpreter closed over) into leading inputs, in
    first-use order; returns the tensors, to be passed in that order."""
    graph = gm.graph
    first = next(iter(graph.nodes))
    consts: list = []
    lifted: dict[str, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        if node.target not in lifted:
            with graph.inserting_before(first):
                lifted[node.target] = graph.placeholder(f"const_{len(consts)}")
            consts.append(getattr(gm, node.target))
        node.replace_all_uses_with(lifted[node.target])
        graph.erase_node(node)
    for name in lifted:
        delattr(gm, name)
    graph.lint()
    gm.recompile()
    return consts


def _fake_constants(gm: torch.fx.GraphModule, consts: list) -> None:
    """Give the lifted constants static fake values in the trace's fake mode (what Inductor compiles from)."""
    from torch._guards import detect_fake_mode

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([n.meta["val"] for n in placeholders[len(consts):] if "val" in n.meta])
    for node, c in zip(placeholders, consts):
        node.meta["val"] = mode.from_tensor(c, static_shapes=True)


def _graph_hash(gm: torch.fx.GraphModule, consts: list) -> str:
    """The traced graph's identity: its code and each input's dtype, shape and stride (symbolic sizes by name)."""
    h = hashlib.sha256(gm.code.encode())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = consts + [n.meta.get("val") for n in placeholders[len(consts):]]
    for v in values:
        if isinstance(v, torch.Tensor):
            h.update(repr((v.dtype, tuple(map(str, v.shape)), tuple(map(str, v.stride())))).encode())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()
