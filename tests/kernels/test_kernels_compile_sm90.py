"""The Triton attention kernels compile for sm_90 (H100 / H200) as the launchers configure them, on any machine
with triton, GPU or not: triton's own ptxas accepts each launch's code and it fits sm_90's shared memory. This
catches what the CPU interpreter cannot: a launch configuration that fails to compile or to load on the GPU.
The launch parameters come from the launchers' own `attend_meta` / `draft_meta` / `combine_meta` and the split
planners, for the embedded default's shapes and MG-30B's."""

from __future__ import annotations

import pytest
import torch

from triton_setup import INTERPRET  # first: sets TRITON_INTERPRET for the interpreter runs of the other modules

triton = pytest.importorskip("triton")

from mg.kernels import triton_attention as ta  # noqa: E402

pytestmark = pytest.mark.skipif(INTERPRET, reason="the Triton interpreter replaces the kernels it would compile")

SM90_SHARED_BYTES = 232448  # the most shared memory one block may use on sm_90 (227 KB)
SMS = 132


def _compile(kernel, meta: dict, pointers: dict[str, str], tmp_path, monkeypatch):
    """Compile `kernel` for sm_90 with `meta` (constexprs + num_warps / num_stages); pointers: name -> element
    type; other runtime arguments are i32 but `scale_log2` (fp32). Returns the compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile now, not from an earlier run's cache
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
    names = kernel.arg_names
    signature = {n: "constexpr" if n in meta else f"*{pointers[n]}" if n in pointers
                 else "fp32" if n == "scale_log2" else "i32" for n in names}
    # As a launch on aligned tensors specializes them: pointers and the strides the launchers pass of
    # contiguous storage divisible by 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in pointers or (n.startswith("stride") and n not in ("stride_pb", "stride_tc"))}
    src = ASTSource(kernel, signature, constexprs={n: meta[n] for n in names if n in meta}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


DRAFT_CASES = [  # (name, T, Hq, Hkv, D, dtype, TF32 dots, cell layout, static span)
    ("embedded drafter, TF32, cells", 16, 6, 2, 64, torch.float32, True, True, 256),
    ("embedded drafter, IEEE, columns", 16, 6, 2, 64, torch.float32, False, False, 256),
    ("embedded drafter, TF32, one split", 16, 6, 2, 64, torch.float32, True, False, 32),
    ("MG-30B drafter, bf16, cells", 16, 32, 8, 128, torch.bfloat16, False, True, 8192),
    ("float32, head_dim 256, group 8, TF32", 16, 64, 8, 256, torch.float32, True, False, 1024),
]


@pytest.mark.parametrize("case", DRAFT_CASES, ids=lambda c: c[0])
def test_drafter_attention_compiles_for_sm90_within_its_shared_memory(case, tmp_path, monkeypatch):
    from mg.kernels import triton_attention_jit as jit

    _, t, hq, hkv, d, dtype, tf32, cell, span = case
    splits = ta.plan_draft_splits(1, hkv, span, SMS)
    meta = ta.draft_meta(t, hq // hkv, d, dtype, splits, cell, tf32)
    data = _dtype_name(dtype)
    part = "fp32" if splits > 1 else data
    pointers = {"q_ptr": data, "kb_ptr": data, "vb_ptr": data, "k_ptr": data, "v_ptr": data, "out_ptr": data,
                "part_o_ptr": part, "part_lse_ptr": part, "pos_ptr": "i64", "slot_ptr": "i64", "table_ptr": "i64"}
    kernel = _compile(jit._draft_attend_kernel, dict(meta), pointers, tmp_path, monkeypatch)
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, (meta, kernel.metadata.shared)
    if splits > 1:
        combine = _compile(jit._combine_splits_kernel, ta.combine_meta(d, splits),
                           {"part_o_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": data}, tmp_path, monkeypatch)
        assert combine.metadata.shared <= SM90_SHARED_BYTES


ATTEND_CASES = [  # (name, queries, slots, Hq, Hkv, D, dtype, cell layout, static span)
    ("embedded target decode, cells", 1, 2, 6, 2, 64, torch.float32, True, 1024),
    ("embedded target prefill, columns", 64, 1, 6, 2, 64, torch.float32, False, 1024),
    ("MG-30B decode, batch 8, columns", 8, 9, 32, 8, 128, torch.bfloat16, False, 32768),
    ("MG-30B prefill chunk, cells", 128, 1, 32, 8, 128, torch.bfloat16, True, 32768),
]


@pytest.mark.parametrize("case", ATTEND_CASES, ids=lambda c: c[0])
def test_attention_compiles_for_sm90_within_its_shared_memory(case, tmp_path, monkeypatch):
    from mg.kernels import triton_attention_jit as jit

    _, n, slots, hq, hkv, d, dtype, cell, span = case
    plan = ta.plan_attention(n, slots, hq, hkv, d, span, dtype, SMS)
    data = _dtype_name(dtype)
    part = "fp32" if plan.num_splits > 1 else data
    pointers = {"q_ptr": data, "k_ptr": data, "v_ptr": data, "out_ptr": data, "part_o_ptr": part,
                "part_lse_ptr": part, "pos_ptr": "i64", "slot_ptr": "i64", "table_ptr": "i64"}
    kernel = _compile(jit._attend_kernel, ta.attend_meta(plan, hq // hkv, d, dtype, cell), pointers, tmp_path,
                      monkeypatch)
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, (plan, kernel.metadata.shared)


@pytest.mark.parametrize("n", [4096, 1000, 32768])  # the embedded default's vocabulary, a masked tile, the widest
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_compiles_for_sm90(n, dtype, tmp_path, monkeypatch):
    from mg.kernels import triton_argmax, triton_argmax_jit as jit

    compiled = _compile(jit._argmax_rows_kernel, triton_argmax.argmax_meta(n),
                        {"x_ptr": _dtype_name(dtype), "out_ptr": "i64"}, tmp_path, monkeypatch)
    assert compiled.metadata.shared <= SM90_SHARED_BYTES
