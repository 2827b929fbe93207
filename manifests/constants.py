"""Names shared by the export stage and the runtime: file names, method names,
constant-method names, layouts and cache policies.

This module is the only place these strings are spelled. It knows nothing about
models, torch or ExecuTorch.
"""

FORMAT = "mg-artifact"
VERSION = 1

# Files of an artifact directory.
MANIFEST_FILE = "manifest.json"
PROGRAM_FILE = "model.pte"
WEIGHTS_FILE = "model.ptd"
TOKENIZER_FILE = "tokenizer.json"

# KV layouts (fixed at export) and per-layer cache policies.
LAYOUT_SEQUENCE = "sequence"
LAYOUT_CELL = "cell"
LAYOUTS = (LAYOUT_SEQUENCE, LAYOUT_CELL)
POLICY_FLAT = "flat"
POLICY_RING = "ring"
POLICIES = (POLICY_FLAT, POLICY_RING)
DTYPES = ("float32", "bfloat16")

# Weight-only quantization schemes of linear layers (float: stored in the model's dtype), and the groups
# of tensors a manifest's `weights` entries name.
WEIGHTS_FLOAT = "float"
WEIGHTS_INT8 = "int8"
WEIGHTS_INT4 = "int4"
WEIGHT_SCHEMES = (WEIGHTS_FLOAT, WEIGHTS_INT8, WEIGHTS_INT4)
INT4_GROUP_SIZES = (32, 64, 128, 256)
GROUP_TARGET_LINEARS = "target.linears"  # every linear of the target's layers
GROUP_TARGET_HEAD = "target.head"  # the LM head (also the drafter's)
GROUP_DRAFT_LINEARS = "draft.linears"  # every linear of the drafter
WEIGHT_GROUPS = (GROUP_TARGET_LINEARS, GROUP_TARGET_HEAD, GROUP_DRAFT_LINEARS)
# How a quantized group's codes were chosen: each weight rounded to nearest (with its group's fitted scale), or
# by GPTQ against the inputs' statistics of calibration text (`mg-export --calibration`).
FIT_ROUND = "round"
FIT_GPTQ = "gptq"
WEIGHT_FITS = (FIT_ROUND, FIT_GPTQ)

# Program methods.
METHOD_FORWARD = "forward"
METHOD_DRAFT_APPEND = "draft_append"
METHOD_DRAFT_BLOCK = "draft_block"

# Constant methods: each returns the value the manifest declares.
GET_OFFGRAPH_KV_MAX_SEQS = "get_offgraph_kv_max_seqs"  # sequence layout only
GET_OFFGRAPH_KV_MAX_CELLS = "get_offgraph_kv_max_cells"  # cell layout only
GET_DRAFT_OFFGRAPH_KV_MAX_SEQS = "get_draft_offgraph_kv_max_seqs"
GET_DRAFT_OFFGRAPH_KV_SEQ_CAPACITY = "get_draft_offgraph_kv_seq_capacity"
GET_MAX_CONTEXT_LEN = "get_max_context_len"
GET_MAX_WRITE = "get_max_write"
GET_VOCAB_SIZE = "get_vocab_size"
GET_MAX_SEQ_LEN = "get_max_seq_len"  # ExecuTorch LLM runner convention: the context per sequence
GET_BOS_ID = "get_bos_id"  # only when the model has a BOS token
GET_EOS_IDS = "get_eos_ids"  # only when the model has EOS tokens
GET_N_LAYERS = "get_n_layers"
GET_KV_HEADS = "get_kv_heads"
GET_HEAD_DIMS = "get_head_dims"
GET_WINDOWS = "get_windows"
GET_BLOCK_SIZE = "get_block_size"
GET_MASK_TOKEN_ID = "get_mask_token_id"
GET_N_TARGET_LAYERS = "get_n_target_layers"
