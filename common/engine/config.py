"""Engine configuration: frozen dataclasses whose defaults say why they are what they are."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from common.roles import ALL_ROLES, Role


class Policy(StrEnum):
    """Batching policy. `stage` is seed 000's Algorithm 1; the other two exist for comparison."""

    STAGE = "stage"
    PREFILL_FIRST = "prefill-first"  # vLLM v0: whole prefills (with their encodes) before any decode
    DECODE_FIRST = "decode-first"  # Sarathi: decodes, then chunked prefill; encodes unbudgeted, inline


class DecodeGraphMode(StrEnum):
    """Decode-only steps padded to fixed buckets and replayed from CUDA graphs (decode_graphs.py)."""

    AUTO = "auto"  # captured on CUDA, where launching kernels from Python bounds a decode step
    OFF = "off"  # never padded
    EAGER = "eager"  # padded, not captured, on any device: its CPU tests (on a GPU: a capture fault or not)


class PackedWeightMode(StrEnum):
    """The decoder's projections kept packed for MKL's GEMM as well (packed.py)."""

    AUTO = "auto"  # on a CPU, in float32, on an instance that decodes: where it pays
    OFF = "off"


class Dtype(StrEnum):
    """The dtypes an engine computes in (`dtype`) or keeps its KV cache in (`kv_cache_dtype`)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class GpuKernels(StrEnum):
    """Which ops a CUDA engine's decoder runs (decoder_ops.py)."""

    # Triton's fused kernels and decode attention read in place, each checked on the device at
    # load (one that fails falls back); torch's ops on a CPU, whose path is tuned as it is.
    AUTO = "auto"
    TORCH = "torch"  # torch's ops everywhere: the path before the fused kernels, kept to compare


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs. Budgets are normally found by the profiler (see profiler.py)."""

    roles: frozenset[Role] = ALL_ROLES
    policy: Policy = Policy.STAGE
    # 16 tokens a block: small enough that a short request wastes little, large enough that the
    # block table stays short (vLLM's default).
    block_size: int = 16
    # CPU: the KV cache is sized by a byte cap. GPU: by a fraction of free memory after weights.
    kv_cache_bytes: int = 256 << 20
    gpu_memory_fraction: float = 0.85
    # The share of the GPU's memory this engine may hold in all (weights, KV, working memory), where
    # several instances share one GPU: the KV cache then takes `gpu_memory_fraction` of what is left
    # of that share once the weights are in, so instances that start at once cannot take each
    # other's memory. None: the GPU is this engine's alone.
    gpu_memory_share: float | None = None
    # τt: tokens in one LLM iteration (decodes count one each, prefill chunks their length).
    token_budget: int = 2048
    # τe: images encoded in one iteration.
    image_budget: int = 8
    # Seed 000 batches encodes beside prefill chunks; seed 001's variant (False) encodes only in
    # iterations without prefill, so a prefill chunk never waits for the vision tower.
    encode_with_prefill: bool = True
    # After a profile is applied, scale τe and τt down (and back up, never past the profile) while
    # full steps run slower than the profile said (governor.py).
    adapt_budgets: bool = True
    # On an instance that decodes and prefills or encodes (PD, EPD, ED): long prompts' chunks and
    # clips' encodes go into steps with decodes only so far as such steps take, on average, at most
    # this many times a decode-only step (pacing.py), so a long clip keeps the TBT of the requests
    # decoding beside it. None: they fill every step, bounded by τt and τe alone.
    tbt_stretch: float | None = 1.5
    # Prompts longer than this many tokens are the long ones paced beside decodes.
    long_prefill: int = 1024
    # Upper bound on concurrently running sequences, so one iteration's decode batch stays bounded.
    max_num_seqs: int = 256
    # Keep full KV blocks for reuse by the hash of everything they depend on (prefix.py): a request
    # computes only what follows its longest cached prefix. Cached blocks give way to any allocation.
    prefix_caching: bool = True
    # Image features kept for reuse, keyed by content hash (0 disables the cache).
    feature_cache_bytes: int = 64 << 20
    # Produce text in RequestOutput. Services turn off: the gateway makes the text from the
    # ordered token stream, and the engine then detokenises only requests with stop strings.
    detokenize: bool = True
    device: str = "cpu"
    # CPU threads for torch; None keeps torch's default (all cores). Several services sharing a
    # machine should split the cores: oversubscribed torch threads spin and slow everyone down.
    num_threads: int | None = None
    # None: float32 on CPU (exact parity with HF), bfloat16 on CUDA.
    dtype: Dtype | None = None
    # Decode-only steps padded to fixed buckets and replayed from CUDA graphs (decode_graphs.py):
    # "auto" captures them on CUDA, where launching kernels from Python bounds a decode step, and
    # leaves the CPU path as it is; "off" never pads; "eager" runs the padded step uncaptured on any
    # device (its CPU tests; on a GPU, it tells a capture fault from a padding fault).
    decode_graphs: DecodeGraphMode = DecodeGraphMode.AUTO
    # CPU, float32, an instance that decodes: the language model's projections also keep their
    # weights packed for MKL's GEMM (packed.py), which decode batches of 2-64 rows run about twice as
    # fast from, for a second copy of the decoder's weights in memory. "off": never.
    packed_weights: PackedWeightMode = PackedWeightMode.AUTO
    # The KV cache's dtype; None: the model's. On a CPU, "float16" or "bfloat16" under a float32
    # model halves the cache's bytes (twice the sequences in the same memory) and what a decode step
    # reads of it, for keys and values rounded to half precision: greedy outputs may then part from
    # HF's at near-ties (docs/engine.md, "A half-precision KV cache").
    kv_cache_dtype: Dtype | None = None
    kernels: GpuKernels = GpuKernels.AUTO

    def __post_init__(self) -> None:
        if not self.roles:
            raise ValueError("an engine needs at least one role")
        if self.block_size <= 0 or self.token_budget <= 0 or self.image_budget <= 0:
            raise ValueError("block_size, token_budget and image_budget must be positive")
        if self.tbt_stretch is not None and self.tbt_stretch <= 1.0:
            raise ValueError(f"tbt_stretch must be above 1 (or None), not {self.tbt_stretch}")
        for name, (kind, may_be_unset) in _ENUMS.items():
            value = getattr(self, name)
            if value is None and may_be_unset:
                continue
            if value not in set(kind):
                unset = " or unset" if may_be_unset else ""
                raise ValueError(f"{name} must be one of {', '.join(kind)}{unset}, not {value!r}")
            object.__setattr__(self, name, kind(value))  # a string becomes its member: still frozen after
        if self.gpu_memory_share is not None and not 0 < self.gpu_memory_share <= 1:
            raise ValueError(f"gpu_memory_share must be in (0, 1] or unset, not {self.gpu_memory_share}")


# EngineConfig's enum fields, and whether each may be None (unset); each takes its values' strings too
# (settings, tests and benchmarks pass them).
_ENUMS: dict[str, tuple[type[StrEnum], bool]] = {
    "policy": (Policy, False),
    "decode_graphs": (DecodeGraphMode, False),
    "packed_weights": (PackedWeightMode, False),
    "dtype": (Dtype, True),
    "kv_cache_dtype": (Dtype, True),
    "kernels": (GpuKernels, False),
}
