"""How one engine runs: the single configuration record shared by `mg-run`, scripts and tests.

Every choice that used to travel as keyword arguments through the engine, the
speculative decoder and the model runner lives here, validated once. Knows no
torch objects beyond the device name; never imports mg.export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SPECULATION_ADAPTIVE = "adaptive"  # per round and per sequence, from measured costs and online acceptance
SPECULATION_FIXED = "fixed"  # always the most drafts the block, the step budget and the request allow
SPECULATION_POLICIES = (SPECULATION_ADAPTIVE, SPECULATION_FIXED)
PROBES_SHADOW = "shadow"  # a probe drafts without verifying; the target's next tokens say what it would accept
PROBES_ROUND = "round"  # a probe is a drafting round (verify rows, or a fused round of every member)
PROBE_KINDS = (PROBES_SHADOW, PROBES_ROUND)


class ConfigError(ValueError):
    """A run configuration that cannot work; one line naming the setting and what is allowed."""


@dataclass(frozen=True)
class RunConfig:
    """device: "cpu" | "cuda". cuda_graphs: None = on for CUDA, off elsewhere. pad_steps: None = pad
    exactly when graphs are on; True pads every call to its bucket (how CPU tests exercise it).
    compile: None = methods compiled to fused code (`compiled.py`) on CUDA, interpreted elsewhere; True/False
    force (compiled methods need padded calls). use_triton: None = Triton attention on CUDA when available.
    n_slots: cell layout only, sequences
    at once (default: the manifest's). dflash: speculate when the artifact has a drafter.
    draft_block: the most rows verified per round (pending token + drafts), 2 .. exported block
    (default: the exported block). speculation: how many drafts each sequence gets per round.
    reserve_kv: None = allocate KV storage at its declared size at start exactly when graphs are on (a graph
    replays fixed addresses, so storage that grew mid-run would have every graph captured again); False
    grows storage as contexts grow (less memory for short contexts). fused_rounds: None = a greedy DFlash
    round of decoding sequences runs as one call (`fused_round.py`: one CUDA graph for draft, verify,
    acceptance and draft context) exactly when graphs are on; True also without graphs (eagerly, e.g. on
    CPU: how tests compare it), False never. cublaslt: None = on CUDA, matrix products go to cuBLASLt
    (process-wide: `torch.backends.cuda.preferred_blas_library`); cuBLAS's default choice for small fp32
    products, e.g. 16 rows x 384 -> 128 columns, runs one thread block for ~50 us where cuBLASLt takes ~4 us.
    False leaves torch's choice alone. draft_tf32: None = on CUDA, the drafter's methods (`draft_block`,
    `draft_append`) run their fp32 matrix products in TF32 (their graphs are captured so; the target's stay
    fp32): drafts are proposals the target verifies, so their precision moves acceptance, never the output.
    False keeps them fp32. int4_tensor_cores: on CUDA (compute capability 8.0+), calls of bfloat16 int4 linears
    with at most `quant.TINYGEMM_MAX_ROWS` rows (decode steps of 1-4 sequences, DFlash rounds of up to 4 rows,
    short chunks) run on torch's tensor-core int4 kernel instead of the Triton kernel: at MG-30B width its
    linears take 0.54x the bf16 time at one row where the Triton kernel takes 0.89x; each weight is laid out
    again for it (as many bytes again as the stored int4 weight). The choice goes by a call's row count, so a
    row's bits then depend on how many rows share its call: greedy DFlash equals target-only, and batched
    equals alone, only up to rounding (off: exactly, the Triton kernel sums a row alike in calls of 1-16
    rows). Changes nothing elsewhere (CPU, float or float32 artifacts). overlap: None = on exactly when graphs
    are on; a greedy plain decode step (no drafts, no prompt chunk) is launched and its tokens read back during
    the next step, whose inputs take them on the device: the host's work of one step runs while the device
    computes the one before (`engine.py`). True also without graphs (on CPU it only reorders the work: how
    tests compare it), False never. row_invariant: on CUDA, the methods' float matrix products (the program's
    `aten::mm`) run as `mg::row_mm` (`mg.kernels.linear`): a Triton linear whose launch depends on the weight's
    shape only, so a row's products are the same bits in a 1-row step, a 16-row DFlash verify or a batch (with
    cuBLAS they are not: greedy DFlash of a bfloat16 artifact equals target-only only up to rounding); compiled
    methods then keep only their symbolic variant, so 1-row calls run the same fused code as longer ones. Off:
    torch's `mm`. On CPU: the attention of decode rows, verify blocks and prompt chunks row-invariant
    (`mg.kernels.cpu_attention`): with int8/int4 artifacts (torch's packed kernels, row-invariant but rounding
    to bfloat16) greedy DFlash then equals target-only and a batch its prompts alone, at 10-35% more time per
    step on the embedded default (BENCHMARKS.md); float32 linears stay torch's `mm`, whose bits depend on the
    call's rows. rows_kernel: on CUDA (and without row_invariant, which takes
    precedence), the methods' float32 matrix products of 1-16 rows (decode steps of up to 16 sequences, DFlash
    verifies and draft blocks) run as `mg::rows_mm` (`mg.kernels.linear`): multiply-adds on CUDA cores in IEEE
    float32 with a launch set by the weight's shape. On an H100, with the weights in L2, it was faster than
    cuBLASLt per product (a forward's products 0.96x at 1 row, 0.86x at 16), but in the model a 1-row forward
    took 23% more kernel time and single prompts ran ~20% slower (rounds 2-4% shorter, batches of 8 6% faster),
    hence off by default. Longer calls and other dtypes stay on torch's `mm`, so a row's bits in a call of more
    than 16 rows (a verify of two or more sequences) differ from its 1-row step's: greedy DFlash equals
    target-only only up to rounding there. The drafter's products it serves run in IEEE float32 rather than
    TF32. Changes nothing on CPU. probes: how adaptive speculation checks a greedy sequence it keeps at plain
    steps (`speculative.py`): "shadow" runs only the drafter's `draft_block` for it, left in flight, and
    compares the drafts with the tokens the target's next steps make (what a round would have accepted, for
    one draft call: no verify rows, no round for the other sequences of a batch, no wait for a step in
    flight); "round" (default) drafts and verifies in a round (a probe that accepts commits its tokens).
    Shadow probes found more of the prompts the drafter serves on an H100 (1.08-1.40x on 7 prompts, round
    probes 0.91-1.17x) but each cost about 0.7 ms of host time there (the context append's and the draft
    call's paths), so the single-prompt median fell to 0.91-0.93x and batches to 0.90-0.92x, against 0.96-0.99x
    with round probes (BENCHMARKS.md); on the CPU a round probe's verify rows cost less than the draft call
    it needs either way. Sampled sequences always probe by rounds."""

    device: str = "cpu"
    cuda_graphs: Optional[bool] = None
    pad_steps: Optional[bool] = None
    compile: Optional[bool] = None
    use_triton: Optional[bool] = None
    n_slots: Optional[int] = None
    dflash: bool = True
    draft_block: Optional[int] = None
    speculation: str = SPECULATION_ADAPTIVE
    reserve_kv: Optional[bool] = None
    fused_rounds: Optional[bool] = None
    cublaslt: Optional[bool] = None
    draft_tf32: Optional[bool] = None
    int4_tensor_cores: bool = False
    overlap: Optional[bool] = None
    row_invariant: bool = False
    rows_kernel: bool = False
    probes: str = PROBES_ROUND

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device is {self.device!r}; allowed: cpu | cuda")
        if self.cuda_graphs and not self.on_cuda:
            raise ConfigError(f"cuda_graphs=True needs device cuda; the device is {self.device}")
        if self.compile and self.pad_steps is False:
            raise ConfigError("compile=True needs padded calls; pad_steps is False")
        if self.speculation not in SPECULATION_POLICIES:
            raise ConfigError(f"speculation is {self.speculation!r}; allowed: {' | '.join(SPECULATION_POLICIES)}")
        if self.probes not in PROBE_KINDS:
            raise ConfigError(f"probes is {self.probes!r}; allowed: {' | '.join(PROBE_KINDS)}")
        if self.n_slots is not None and self.n_slots < 1:
            raise ConfigError(f"n_slots is {self.n_slots}; allowed: an integer >= 1")

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def graphs(self) -> bool:
        """CUDA graphs on?"""
        return self.on_cuda if self.cuda_graphs is None else self.cuda_graphs

    @property
    def compiled(self) -> bool:
        """Run methods as compiled fused code?"""
        return self.on_cuda if self.compile is None else self.compile

    @property
    def reserved(self) -> bool:
        """Allocate KV storage whole at start?"""
        return self.graphs if self.reserve_kv is None else self.reserve_kv

    @property
    def fused(self) -> bool:
        """Run greedy DFlash rounds as one fused call?"""
        return self.graphs if self.fused_rounds is None else self.fused_rounds

    @property
    def shadow_probes(self) -> bool:
        """Does adaptive speculation probe greedy sequences in the shadow?"""
        return self.probes == PROBES_SHADOW

    @property
    def overlapped(self) -> bool:
        """Read a greedy plain step's tokens back during the next step?"""
        return self.graphs if self.overlap is None else self.overlap

    @property
    def prefer_cublaslt(self) -> bool:
        """Send CUDA matrix products to cuBLASLt?"""
        return self.on_cuda if self.cublaslt is None else (self.cublaslt and self.on_cuda)

    @property
    def drafter_tf32(self) -> bool:
        """Run the drafter's fp32 matrix products in TF32?"""
        return self.on_cuda if self.draft_tf32 is None else (self.draft_tf32 and self.on_cuda)

    @property
    def row_invariant_mm(self) -> bool:
        """Serve the program's `aten::mm` with `mg::row_mm`?"""
        return self.row_invariant and self.on_cuda

    @property
    def row_invariant_attention(self) -> bool:
        """Attend every row row-invariantly on the CPU (`mg.kernels.cpu_attention`)?"""
        return self.row_invariant and not self.on_cuda

    @property
    def rows_mm(self) -> bool:
        """Serve the program's `aten::mm` with `mg::rows_mm`?"""
        return self.rows_kernel and self.on_cuda and not self.row_invariant

    @property
    def padded(self) -> bool:
        """Pad every method call to its bucket?"""
        return (self.graphs or self.compiled) if self.pad_steps is None else self.pad_steps
