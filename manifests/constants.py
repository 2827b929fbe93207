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
