"""mg.kernels: custom op schemas, torch reference attention, and (on CUDA) Triton kernels.

Importing this package registers the `mg::` ops with torch.
"""

from . import ops  # noqa: F401  (registers the mg:: op schemas)
from . import quant  # noqa: F401  (registers the quantized linears)
from . import linear  # noqa: F401  (registers the float matrix products the runtime may serve)
from .attention_ref import attend_cells_ref, attend_columns_ref, attend_dense_ref, attend_gathered_ref, key_span

__all__ = ["ops", "quant", "linear", "attend_cells_ref", "attend_columns_ref", "attend_dense_ref",
           "attend_gathered_ref", "key_span"]
