"""The program runner: faithful to ExecuTorch's runtime op by op, equal to the eager model end to end,
and strict at load time. Exports take tens of seconds: the tiny MG artifact is conftest's (one per
session); this module exports the model's pieces without custom ops (which ExecuTorch's own runtime
can execute) and one program of control flow and ops beyond MG's."""

from pathlib import Path

import pytest
import torch
from torch.export import Dim

import mg.kernels  # noqa: F401  (registers the mg:: op schemas)
from mg.export.config import PRESETS
from mg.export.lower import ProgramParts, export_lifted, lifted_tensors, to_program
from mg.export.ptd import PtdTensor, write_ptd
from mg.export.model import MuseGlimmer, init_random
from mg.export.reference import ReferenceKV
from mg.runtime.program import Program, ProgramError

CFG = PRESETS["tiny"]
ATTEND = "mg::update_and_attend"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Deterministic mm reductions and no oversubscription on shared CPUs."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def mg_pte(tiny_seq_artifact) -> Path:
    """The tiny MG artifact's program (conftest: sequence layout, 24 tokens per step)."""
    return tiny_seq_artifact / "model.pte"


class Piece(torch.nn.Module):
    """One piece of the MG model as a method: fn(owner, *inputs)."""

    def __init__(self, owner, fn):
        super().__init__()
        self.owner, self.fn = owner, fn

    def forward(self, a, b=None):
        return self.fn(self.owner, a) if b is None else self.fn(self.owner, a, b)


def _pieces():
    model = init_random(MuseGlimmer(CFG), 0).eval()
    block = model.layers[0]  # a ring layer: RoPE included
    assert not CFG.is_global(0)
    x, n, r = torch.randn(5, CFG.dim), Dim("n", min=1, max=16), Dim("r", min=1, max=16)
    no_cache = lambda q, k, v, positions, seq_slots, layer_id, scale: q * scale  # noqa: E731
    return {
        "embed": (Piece(model, lambda m, t: m.embed(t)), (torch.arange(5),), ({0: n},)),
        "norm": (Piece(block, lambda b, h: b.attn_norm(h)), (x,), ({0: n},)),
        "attention": (Piece(block.attn, lambda a, h, p: a(h, p, p, no_cache)), (x, torch.arange(5)), ({0: n}, {0: n})),
        "ffn": (Piece(block.ffn, lambda f, h: f(h)), (x,), ({0: n},)),
        "logits": (Piece(model, lambda m, h, rows: m.logits(h.index_select(0, rows))), (x, torch.tensor([1, 3])),
                   ({0: n}, {0: r})),
    }


def _piece_inputs():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(7, CFG.dim, generator=gen)  # 7 rows: not the export example's 5
    return {
        "embed": [torch.tensor([3, 500, 7, 7, 0, 11, 2])],
        "norm": [h],
        "attention": [h, torch.arange(7) + 30],
        "ffn": [h],
        "logits": [h, torch.tensor([6, 0, 2])],
    }


@pytest.fixture(scope="module")
def pieces_pte(tmp_path_factory) -> Path:
    """The MG model's pieces, lowered exactly like the artifact (same `export_lifted` + `to_program`, weights in
    a .ptd beside it), without mg:: ops."""
    pieces = _pieces()
    methods = {name: export_lifted(m, ex, dyn) for name, (m, ex, dyn) in pieces.items()}
    values: dict[str, torch.Tensor] = {}
    for m, _, _ in pieces.values():
        for key, t in lifted_tensors(m).items():
            assert values.setdefault(key, t) is t, f"two tensors under one key {key!r}"
    program, external = to_program(ProgramParts(methods, {}))
    path = tmp_path_factory.mktemp("pieces") / "pieces.pte"
    path.write_bytes(program)
    write_ptd(path.with_suffix(".ptd"), [
        PtdTensor(k, d, s, lambda k=k, d=d: iter([values[k].detach().to(d).contiguous().reshape(-1)]))
        for k, (d, s) in external.items()])
    return path


def _packed_prompt():
    """Two sequences of 12 and 8 tokens packed on one axis (slots 0 and 1)."""
    tokens = torch.randint(0, CFG.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(12), torch.arange(8)])
    seq_slots = torch.cat([torch.zeros(12, dtype=torch.long), torch.ones(8, dtype=torch.long)])
    return tokens, positions, seq_slots, torch.tensor([11, 19])


def _forward_ops(mg_pte) -> set[str]:
    return set(Program.load(mg_pte, data_path=mg_pte.with_suffix(".ptd"), custom_ops={ATTEND: None}).info("forward").operators)


def test_runner_matches_executorch_runtime_on_each_op(pieces_pte, mg_pte):
    from executorch.runtime import Runtime

    theirs = Runtime.get().load_program(pieces_pte, data_path=str(pieces_pte.with_suffix(".ptd")))
    for views_as_copies in (False, True):
        ours = Program.load(pieces_pte, views_as_copies=views_as_copies, data_path=pieces_pte.with_suffix(".ptd"))
        for name, inputs in _piece_inputs().items():
            expected = theirs.load_method(name).execute(inputs)
            got = ours.run(name, inputs)
            assert len(got) == len(expected)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")
    covered = set().union(*(ours.info(m).operators for m in ours.method_names))
    used = {op for op in _forward_ops(mg_pte) if not op.startswith("mg::")}
    assert used <= covered, f"MG program ops without a faithfulness check: {sorted(used - covered)}"


class Branch(torch.nn.Module):
    def forward(self, x, y):
        return torch.cond(x.sum() > 0, lambda a, b: a + b, lambda a, b: a - 2 * b, (x, y))


class Wide(torch.nn.Module):
    """Ops beyond the MG program: factories, multi-output ops, reductions with dtype, casts, batched mm."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x, idx):
        n = x.shape[0]
        y = self.ln(x) + torch.arange(n, dtype=torch.float32)[:, None] + torch.full((1, 8), 0.5)
        s = torch.softmax(y @ self.w.t(), dim=-1)
        m = torch.where(s > 0.1, s, torch.zeros_like(s)).masked_fill(idx[:, None] == 0, -1.0)
        top_values, top_indices = torch.topk(m, 3, dim=-1)
        b = torch.bmm(y.view(n, 2, 4).transpose(1, 2), y.view(n, 2, 4))
        z = y[:, 2:6].unsqueeze(0).expand(2, n, 4).sum(dtype=torch.float64)
        return (*m.max(dim=-1), top_values, top_indices, b, z, y.reshape(n, 4, 2).unbind(1)[1].to(torch.bfloat16),
                torch.cumsum(y, 0), (x.abs() + 1).log().mean(-1, keepdim=True))


@pytest.fixture(scope="module")
def misc_pte(tmp_path_factory) -> Path:
    n = Dim("n", min=2, max=16)
    with torch.no_grad():
        methods = {
            "branch": torch.export.export(Branch(), (torch.randn(4), torch.randn(4)), strict=False),
            "wide": torch.export.export(Wide().eval(), (torch.randn(5, 8), torch.tensor([0, 1, 2, 0, 1])),
                                        dynamic_shapes=({0: n}, {0: n}), strict=False),
        }
    path = tmp_path_factory.mktemp("misc") / "misc.pte"
    path.write_bytes(to_program(ProgramParts(methods, {}))[0])  # plain exports: weights inside the program
    return path


def test_control_flow_matches_executorch_runtime(misc_pte):
    """torch.cond lowers to JumpFalseCall / MoveCall instructions; both branches must run as ExecuTorch runs them."""
    from executorch.runtime import Runtime

    ours, theirs = Program.load(misc_pte), Runtime.get().load_program(misc_pte).load_method("branch")
    gen = torch.Generator().manual_seed(4)
    for sign in (1.0, -1.0):
        x, y = sign * torch.rand(4, generator=gen), torch.randn(4, generator=gen)
        torch.testing.assert_close(ours.run("branch", [x, y])[0], theirs.execute([x, y])[0], atol=0, rtol=0)


def test_ops_beyond_the_mg_program_match_executorch_runtime(misc_pte):
    from executorch.runtime import Runtime

    theirs = Runtime.get().load_program(misc_pte).load_method("wide")
    inputs = [torch.randn(7, 8, generator=torch.Generator().manual_seed(5)), torch.tensor([0, 1, 2, 0, 1, 3, 0])]
    expected = theirs.execute(inputs)
    for views_as_copies in (False, True):
        got = Program.load(misc_pte, views_as_copies=views_as_copies).run("wide", inputs)
        assert len(got) == len(expected)
        for k, (a, b) in enumerate(zip(got, expected)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"output {k}: {m}")


@torch.no_grad()
def test_exported_forward_matches_eager_model(mg_pte):
    model = init_random(MuseGlimmer(CFG), 0).eval()
    prog = Program.load(mg_pte, data_path=mg_pte.with_suffix(".ptd"), custom_ops={ATTEND: ReferenceKV(CFG)})
    eager_kv = ReferenceKV(CFG)
    prompt = _packed_prompt()
    got = prog.run("forward", list(prompt))[0]
    want, _ = model(*prompt, eager_kv)
    assert got.shape == (2, CFG.vocab_size)
    assert (got - want).abs().max() <= 1e-4
    decode = (got.argmax(-1), torch.tensor([12, 8]), torch.tensor([0, 1]), torch.tensor([0, 1]))
    got = prog.run("forward", list(decode))[0]
    want, _ = model(*decode, eager_kv)
    assert (got - want).abs().max() <= 1e-4


def test_constant_methods_read_as_ints_and_lists(mg_pte):
    prog = Program.load(mg_pte, data_path=mg_pte.with_suffix(".ptd"), custom_ops={ATTEND: None})
    assert prog.constant("get_vocab_size") == CFG.vocab_size
    assert prog.constant("get_max_write") == 24
    assert prog.constant("get_windows") == [CFG.window(i) for i in range(CFG.n_layers)]


@torch.no_grad()
def test_views_match_copies_and_folded_matches_unfolded(mg_pte):
    prompt = list(_packed_prompt())
    results, folded = {}, {}
    for views_as_copies in (False, True):
        for fold in (False, True):
            prog = Program.load(mg_pte, data_path=mg_pte.with_suffix(".ptd"), custom_ops={ATTEND: ReferenceKV(CFG)}, views_as_copies=views_as_copies,
                                fold_constants=fold)
            results[views_as_copies, fold] = prog.run("forward", prompt)[0]
            folded[views_as_copies, fold] = prog.info("forward").n_folded
    assert folded[False, False] == folded[True, False] == 0
    assert folded[False, True] >= CFG.n_layers * 4 + 1  # at least every weight permute (4 per layer + head)
    for views_as_copies in (False, True):
        assert torch.equal(results[views_as_copies, True], results[views_as_copies, False])
    # mm on a transposed weight view and on its contiguous copy may round differently in the last bit
    torch.testing.assert_close(results[False, True], results[True, False], atol=1e-6, rtol=1e-6)


def test_unsupported_operator_is_refused_at_load_with_its_name(mg_pte, tmp_path):
    from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary

    pte = deserialize_pte_binary(mg_pte.read_bytes())
    for op in pte.program.execution_plan[0].operators:
        if op.name == "aten::tanh":
            op.name = "aten::foo"
    bad = tmp_path / "foo.pte"
    bad.write_bytes(bytes(serialize_pte_binary(pte)))
    with pytest.raises(ProgramError, match=r"method 'forward' uses operator 'aten::foo.out' which this runner "
                                           r"does not support"):
        Program.load(bad, custom_ops={ATTEND: None}, data_path=mg_pte.with_suffix(".ptd"))


def test_undeclared_or_unbound_custom_op_is_refused(mg_pte):
    with pytest.raises(ProgramError, match="'mg::update_and_attend.out'"):
        Program.load(mg_pte, data_path=mg_pte.with_suffix(".ptd"))
    prog = Program.load(mg_pte, data_path=mg_pte.with_suffix(".ptd"), custom_ops={ATTEND: None})
    with pytest.raises(ProgramError, match="not bound"):
        prog.run("forward", list(_packed_prompt()))


@pytest.mark.parametrize("damage", ["truncated", "cut_in_header", "not_a_program", "missing"])
def test_corrupt_program_is_refused_with_one_line_naming_the_file(mg_pte, tmp_path, damage):
    data = mg_pte.read_bytes()
    path = tmp_path / "bad.pte"
    content = {"truncated": data[:len(data) // 2], "cut_in_header": data[:200], "not_a_program": b"{}\n" * 40}
    if damage in content:
        path.write_bytes(content[damage])
    with pytest.raises(ProgramError) as err:
        Program.load(path, custom_ops={ATTEND: None})
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_program_loads_without_the_exporter_and_the_exporter_still_imports_after(tiny_seq_artifact):
    """A fresh process reads the .pte without running executorch.exir's package init (the whole exporter);
    the tokens are those of this process, which imported the exporter; importing the exporter afterwards
    still works."""
    import json
    import subprocess
    import sys

    from mg.runtime.artifact import load_artifact
    from mg.runtime.engine import Engine
    from mg.runtime.scheduler import Request

    script = f"""
import json, sys
from mg.runtime.artifact import load_artifact
from mg.runtime.engine import Engine
from mg.runtime.scheduler import Request
art = load_artifact({str(tiny_seq_artifact)!r})
tokens = Engine(art).run([Request("a", (1, 5, 6, 7), 6)])[0].tokens
light = "executorch.exir.program" not in sys.modules
from executorch.exir import to_edge  # the real package init runs now and reuses the reader's modules
print(json.dumps({{"tokens": list(tokens), "light": light, "to_edge": callable(to_edge)}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    want = Engine(load_artifact(tiny_seq_artifact)).run([Request("a", (1, 5, 6, 7), 6)])[0].tokens
    assert got == {"tokens": list(want), "light": True, "to_edge": True}
