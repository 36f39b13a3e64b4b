"""The engine's CUDA-only paths, checked on CPU by their contracts.

- flash-attn's varlen call: `varlen_attention_reference` states its semantics in torch and is
  checked against plain per-sequence SDPA; forced in with `use_varlen_kernel`, the runner's flash
  metadata (cu_seqlens, gathered context slots, max lengths) must give the SDPA path's logits and
  HF's greedy tokens.
- bfloat16 (the CUDA default): encode → prefill → decode runs with no dtype error and stays
  close to float32.
- the vision stream: encodes overlapped with the LLM are simulated by a stream whose work lands
  only when another stream waits on it, so a forward that read features too early sees NaN.

The tests marked `needs_flash` run the real kernel, and only on a GPU with flash-attn installed;
`needs_cuda` ones (CUDA-graph decode steps) on any GPU. The padded step those graphs capture is
checked on CPU in test_decode_graphs.py and test_parity*.py.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from common.engine import attention
from common.engine.attention import (
    AttentionMetadata,
    flash_attn_varlen_func,
    use_varlen_kernel,
    varlen_attention_reference,
    varlen_kernel,
)
from common.engine.config import EngineConfig, Policy
from common.engine.engine import Engine
from common.engine.sampling import SamplingParams
from tests.helpers.engine import QUESTIONS
from tests.helpers.images import make_image

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_flash = pytest.mark.skipif(
    not (torch.cuda.is_available() and flash_attn_varlen_func is not None),
    reason="needs a CUDA device and flash-attn",
)


# -- the reference kernel ---------------------------------------------------------------------------


def packed(lengths: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, seed: int = 0):
    """Random q/k/v packed for (q_len, k_len) sequences, and their cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(q for q, _ in lengths), sum(k for _, k in lengths)
    q = torch.randn(total_q, heads, dim, generator=gen)
    k = torch.randn(total_k, kv_heads, dim, generator=gen)
    v = torch.randn(total_k, kv_heads, dim, generator=gen)
    cu_q = torch.tensor([0] + [q for q, _ in lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + [k for _, k in lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def sdpa_per_sequence(q, k, v, cu_q, cu_k) -> torch.Tensor:
    """The expected output, derived independently: a sequence's q_len queries are the last q_len
    positions of a causal sequence of k_len tokens, so they are placed there (zeros in front),
    SDPA runs plainly causal over k_len × k_len, and their rows are taken back. Query head h is
    given kv head h // (heads // kv_heads) explicitly."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kv_of = torch.tensor([h // (heads // kv_heads) for h in range(heads)])
    out = []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        q_len, k_len = len(qs), len(ks)
        full = torch.zeros(k_len, heads, q.shape[2])
        full[k_len - q_len :] = qs
        o = F.scaled_dot_product_attention(
            full.transpose(0, 1), ks[:, kv_of].transpose(0, 1), vs[:, kv_of].transpose(0, 1), is_causal=True
        )
        out.append(o.transpose(0, 1)[k_len - q_len :])
    return torch.cat(out)


MIXED = [(7, 7), (1, 19), (5, 21), (16, 16), (1, 1), (3, 40), (12, 13)]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 2), (4, 1), (4, 4)])
def test_reference_matches_per_sequence_sdpa(heads, kv_heads):
    """Mixed lengths: full prefills (q_len = k_len), chunks after a cached context and decodes
    (q_len < k_len), under GQA, MQA and MHA."""
    q, k, v, cu_q, cu_k = packed(MIXED, heads, kv_heads, 16)
    got = varlen_attention_reference(q, k, v, cu_q, cu_k, 16, 40, causal=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, sdpa_per_sequence(q, k, v, cu_q, cu_k), atol=1e-5, rtol=1e-5)


def test_reference_scale_and_non_causal():
    q, k, v, cu_q, cu_k = packed([(3, 9), (4, 4)], 4, 2, 16)
    kv_of = torch.tensor([0, 0, 1, 1])
    got = varlen_attention_reference(q, k, v, cu_q, cu_k, 4, 9, softmax_scale=0.3)
    for b in range(2):
        qs, ks, vs = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        want = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks[:, kv_of].transpose(0, 1), vs[:, kv_of].transpose(0, 1), scale=0.3
        )
        torch.testing.assert_close(got[cu_q[b] : cu_q[b + 1]], want.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_reference_causal_mask_is_bottom_right_as_flash_attn_documents():
    """flash-attn's own examples: q_len 2, k_len 5 keeps [1 1 1 1 0; 1 1 1 1 1]; q_len 5, k_len 2
    keeps [0 0; 0 0; 0 0; 1 0; 1 1], and rows with no key are zero."""
    q, k, v, cu_q, cu_k = packed([(2, 5)], 2, 2, 8)
    base = varlen_attention_reference(q, k, v, cu_q, cu_k, 2, 5, causal=True)
    v2 = v.clone()
    v2[4] += 1.0  # only the last query may see the last key
    moved = varlen_attention_reference(q, k, v2, cu_q, cu_k, 2, 5, causal=True)
    assert torch.equal(moved[0], base[0]) and not torch.allclose(moved[1], base[1])
    v3 = v.clone()
    v3[3] += 1.0  # both see key 3
    moved = varlen_attention_reference(q, k, v3, cu_q, cu_k, 2, 5, causal=True)
    assert not torch.allclose(moved[0], base[0]) and not torch.allclose(moved[1], base[1])

    q, k, v, cu_q, cu_k = packed([(5, 2)], 2, 2, 8)
    out = varlen_attention_reference(q, k, v, cu_q, cu_k, 5, 2, causal=True)
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    torch.testing.assert_close(out[3], v[0])  # one key: softmax weight 1


def test_reference_rejects_what_the_kernel_cannot_take():
    q, k, v, cu_q, cu_k = packed([(3, 9), (4, 4)], 4, 2, 16)
    ok = varlen_attention_reference(q, k, v, cu_q, cu_k, 4, 9, causal=True)
    assert ok.shape == q.shape
    bad = [
        ((q, k, v, cu_q.long(), cu_k, 4, 9), "int32"),
        ((q, k, v, cu_q, cu_k, 3, 9), "max_seqlen_q"),  # below the longest query sequence
        ((q, k, v, cu_q, cu_k, 4, 8), "max_seqlen_k"),
        ((q, k, v, cu_q, cu_k[:-1], 4, 9), "rise from 0"),
        ((q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu_q, cu_k, 4, 9), "multiple"),
        ((q, k, v.double(), cu_q, cu_k, 4, 9), "dtype"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            varlen_attention_reference(*args, causal=True)


def test_kernel_choice_keeps_production_behaviour():
    """flash-attn only on CUDA with a half-precision cache; SDPA elsewhere; forced inside the
    context manager only."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert varlen_kernel(cpu, torch.float32) is None and varlen_kernel(cpu, torch.bfloat16) is None
    assert varlen_kernel(cuda, torch.bfloat16) is flash_attn_varlen_func  # None when not installed
    assert varlen_kernel(cuda, torch.float16) is flash_attn_varlen_func
    assert varlen_kernel(cuda, torch.float32) is None  # flash-attn takes fp16/bf16 only
    with use_varlen_kernel() as kernel:
        assert kernel is varlen_attention_reference
        assert varlen_kernel(cpu, torch.float32) is varlen_attention_reference
    assert varlen_kernel(cpu, torch.float32) is None and attention._forced_kernel is None


# -- the runner's flash path ---------------------------------------------------------------------


@dataclass
class Run:
    """What one `ModelRunner.run` call saw and gave."""

    encodes: list[str]
    prefills: list[tuple[str, int, int]]  # (request id, tokens computed before, chunk length)
    decodes: list[tuple[str, int]]  # (request id, context length including the decoded token)
    tables: dict[str, list[int]]  # block tables of the requests in the LLM batch
    sampled: list[str] = field(default_factory=list)
    logits: torch.Tensor | None = None
    meta: AttentionMetadata | None = None

    @property
    def shape(self):
        return self.encodes, self.prefills, self.decodes


def record(engine) -> list[Run]:
    """Record every run of the engine's runner: its batch, block tables, logits and metadata."""
    runs: list[Run] = []
    runner = engine.runner
    real_run, real_metadata = runner.run, runner._metadata

    def metadata(*args):
        runs[-1].meta = real_metadata(*args)
        return runs[-1].meta

    def run(batch):
        llm = [r for r, _ in batch.prefills] + batch.decodes
        runs.append(
            Run(
                [r.request_id for r, _ in batch.encodes],
                [(r.request_id, r.num_computed_tokens, n) for r, n in batch.prefills],
                [(r.request_id, r.num_tokens) for r in batch.decodes],
                {r.request_id: list(engine.blocks.table(r.request_id)) for r in llm},
            )
        )
        result = real_run(batch)
        runs[-1].sampled = [r.request_id for r in result.sampled]
        runs[-1].logits = None if result.logits is None else result.logits.clone()
        return result

    runner.run, runner._metadata = run, metadata
    return runs


# Requests arriving over the first steps (step → [(question, images)]). With a 24-token budget
# this gives iterations that mix a chunk continuing a cached context, a new prompt's first chunk
# and decodes, and chunks that start or end inside an image. With ignore_eos the schedule depends
# on lengths only, never on the tokens drawn, so engines driven alike run the same batches.
ARRIVALS = {0: [(2, 0), (1, 0)], 1: [(0, 1)], 3: [(3, 0)]}
BUDGET = 24


def drive(engine, flash: bool = False, arrivals=ARRIVALS, max_tokens: int = 6) -> list[Run]:
    runs = record(engine)
    images = [make_image(i) for i in range(2)]
    step = 0
    while step in arrivals or engine.has_unfinished():
        for question, n in arrivals.get(step, []):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(engine.chat_prompt(QUESTIONS[question], n), images[:n], params)
        with use_varlen_kernel() if flash else nullcontext():
            engine.step()
        step += 1
    engine.check_integrity()
    return runs


@pytest.fixture(scope="module")
def float32_sdpa_runs(tiny_model_dir) -> list[Run]:
    """The plain CPU engine (float32, SDPA) over ARRIVALS: the baseline several tests compare to."""
    return drive(Engine(tiny_model_dir, EngineConfig(token_budget=BUDGET)))


def first_logits(runs: list[Run]) -> dict[str, torch.Tensor]:
    """Each request's first-token logits (the prefill's: they depend on its prompt alone)."""
    out: dict[str, torch.Tensor] = {}
    for run in runs:
        for i, rid in enumerate(run.sampled):
            out.setdefault(rid, run.logits[i])
    return out


def check_flash_metadata(run: Run, block_size: int, kernel) -> None:
    """The varlen metadata follows from the batch and the block tables alone: a chunk of n after
    c cached tokens is sequence (q n, k c + n), a decode (q 1, k its whole context); the keys are
    the context's slots in position order (so the kernel's bottom-right causal alignment puts the
    queries at its end)."""
    seqs = [(rid, n, done + n) for rid, done, n in run.prefills] + [(rid, 1, c) for rid, c in run.decodes]
    bs, table = block_size, run.tables
    slots = [table[rid][p // bs] * bs + p % bs for rid, _, k in seqs for p in range(k)]
    meta = run.meta
    assert meta.use_flash and meta.varlen_kernel is kernel
    assert meta.cu_seqlens_q.dtype == meta.cu_seqlens_k.dtype == torch.int32
    assert meta.cu_seqlens_q.tolist() == torch.tensor([0] + [q for _, q, _ in seqs]).cumsum(0).tolist()
    assert meta.cu_seqlens_k.tolist() == torch.tensor([0] + [k for _, _, k in seqs]).cumsum(0).tolist()
    assert meta.flash_slots.tolist() == slots
    assert (meta.max_q, meta.max_k) == (max(q for _, q, _ in seqs), max(k for _, _, k in seqs))


def test_flash_metadata_gives_the_sdpa_logits_on_mixed_batches(make_engine, float32_sdpa_runs):
    """Two engines in lockstep, one on SDPA and one through the varlen path with the reference
    kernel: every iteration's metadata is what its batch implies, and its logits are SDPA's.

    Measured: max |logit diff| 4.5-4.8e-05 on logits of std 5 and |max| 20 (float32 summation order
    over 4 layers, ~10-20 ulps); a broken contract moves them by whole units."""
    sdpa = float32_sdpa_runs
    flash = drive(make_engine(token_budget=BUDGET), flash=True)
    assert [r.shape for r in flash] == [r.shape for r in sdpa]
    assert all(r.meta is None or not r.meta.use_flash for r in sdpa)
    mixed, worst = 0, 0.0
    for f, s in zip(flash, sdpa, strict=True):
        if f.meta is None:  # an encode-only iteration runs no LLM
            continue
        check_flash_metadata(f, 16, varlen_attention_reference)
        continuing = any(done > 0 for _, done, _ in f.prefills)
        mixed += len(f.prefills) >= 2 and continuing and bool(f.decodes)
        assert f.sampled == s.sampled
        if s.logits is not None:
            worst = max(worst, (f.logits - s.logits).abs().max().item())
            torch.testing.assert_close(f.logits, s.logits, atol=2e-4, rtol=0)
    assert mixed >= 1, "no iteration mixed a continuing chunk, a new chunk and decodes"
    print(f"varlen reference vs SDPA, float32 logits: max |diff| {worst:.1e}")


@pytest.mark.parametrize("num_images", [0, 2])
def test_greedy_through_the_flash_path_equals_hf(make_engine, hf_generate, images, num_images):
    """A 16-token budget chunks the prompt (inside images too), so chunks continue cached contexts."""
    engine = make_engine(token_budget=16)
    runs = record(engine)
    prompt = engine.chat_prompt(QUESTIONS[num_images], num_images)
    with use_varlen_kernel():
        (got,) = engine.generate([prompt], [images[:num_images]], SamplingParams(max_tokens=16))
    assert got.token_ids == hf_generate(prompt, images[:num_images], 16)
    assert any(r.prefills and r.prefills[0][1] > 0 for r in runs)  # a chunk continued a context
    assert all(r.meta.use_flash for r in runs if r.meta is not None)


# -- bfloat16 --------------------------------------------------------------------------------------


def assert_close_to_float32(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str = "bf16 vs f32"
) -> None:
    """bf16 keeps 8 significant bits (rounding 2^-9 ≈ 0.2 % per op); over the vision tower, 4
    decoder layers and the LM head that measured max |Δ| ≤ 0.21 σ of the float32 logits (σ ≈ 5,
    |max| ≈ 20) and cosine ≥ 0.998. Allowed: 0.5 σ and cosine ≥ 0.99. Broken contracts measured
    far outside: image features left out 3.7-5.6 σ, cosine ≤ 0.25; causal mask aligned top-left
    3.9-5.0 σ, cosine ≤ 0.33."""
    assert got.keys() == want.keys()
    for rid, ref in want.items():
        out = got[rid]
        assert out.dtype == torch.float32 and torch.isfinite(out).all(), rid
        diff = (out - ref).abs().max().item() / ref.std().item()
        cos = F.cosine_similarity(out, ref, dim=0).item()
        print(f"{rid}: {label} max |diff| {diff:.2f} sigma, cosine {cos:.4f}")
        assert diff <= 0.5 and cos >= 0.99, (rid, diff, cos)


@pytest.mark.parametrize("flash", [False, True], ids=["sdpa", "varlen"])
def test_bfloat16_engine_runs_and_stays_close_to_float32(make_engine, float32_sdpa_runs, flash):
    """The CUDA default dtype, on CPU: every weight, the KV cache and the vision features are bf16
    and encode → chunked prefill (inside images) → decode meets no dtype mismatch; logits are
    float32. `varlen`: bf16 through the flash path, as production runs on a GPU."""
    engine = make_engine(token_budget=BUDGET, dtype="bfloat16")
    seen = []
    encode = engine.runner.encode

    def spy(encodes):
        encode(encodes)
        seen.extend(req.images[i].features for req, idx in encodes for i in idx)

    engine.runner.encode = spy
    runs = drive(engine, flash=flash)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.cache.kv.dtype == torch.bfloat16
    assert seen and all(f.dtype == torch.bfloat16 for f in seen)
    assert any(r.decodes for r in runs) and any(r.encodes for r in runs)
    assert all(r.meta is None or r.meta.use_flash == flash for r in runs)
    assert_close_to_float32(first_logits(runs), first_logits(float32_sdpa_runs))


# -- the vision stream -----------------------------------------------------------------------------


class DeferredStreams:
    """Stand-ins for CUDA streams, installed over torch.cuda for one engine's runner.

    Features encoded while the vision stream is current are NaN until the current stream waits on
    the vision stream; then they land, in place. That is the most a GPU allows: work queued on
    another stream need not have run before later work on this one, unless this one waits."""

    def __init__(self, monkeypatch, engine) -> None:
        self.main, self.vision = _Stream(self), _Stream(self)
        self.current = self.main
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.overlapped = 0  # LLM forwards run while encodes were still in flight
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        engine.runner.vision_stream = self.vision
        runner, model = engine.runner, engine.model
        encode, forward = model.encode, runner.forward

        def deferred_encode(images, device, dtype):
            out = encode(images, device, dtype)
            if self.current is not self.vision:
                return out
            placeholders = [torch.full_like(f, float("nan")) for f in out]
            self.pending += zip(placeholders, out, strict=True)
            return placeholders

        def counted_forward(prefills, decodes):
            self.overlapped += bool(self.pending)
            return forward(prefills, decodes)

        monkeypatch.setattr(model, "encode", deferred_encode)
        monkeypatch.setattr(runner, "forward", counted_forward)

    @contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


class _Stream:
    def __init__(self, streams: DeferredStreams) -> None:
        self.streams = streams

    def wait_stream(self, other: _Stream) -> None:
        if other is self.streams.vision and self is not other:
            for placeholder, value in self.streams.pending:
                placeholder.copy_(value)
            self.streams.pending.clear()


# Images arriving while others prefill and decode, under each policy: `stage` encodes beside
# other requests' chunks (independent work, overlapped); `decode-first` encodes a request's images
# in the iteration that prefills it (inline: the encode must finish before the LLM reads them).
STREAM_ARRIVALS = {0: [(2, 0)], 1: [(0, 1)], 2: [(3, 1)]}


@pytest.mark.parametrize("policy", [Policy.STAGE, Policy.DECODE_FIRST])
def test_vision_stream_contract(make_engine, monkeypatch, policy):
    """`run` without a stream (CPU), and with a vision stream whose work lands only when waited
    for, both give exactly what encoding first and then running the LLM gives."""
    serial = make_engine(token_budget=BUDGET, policy=policy)
    runner = serial.runner

    @torch.inference_mode()
    def encode_then_forward(batch):
        runner.encode(batch.encodes)
        return runner.forward(batch.prefills, batch.decodes)

    runner.run = encode_then_forward
    want = drive(serial, arrivals=STREAM_ARRIVALS)

    plain = make_engine(token_budget=BUDGET, policy=policy)
    assert plain.runner.vision_stream is None
    streamed = make_engine(token_budget=BUDGET, policy=policy)
    streams = DeferredStreams(monkeypatch, streamed)
    for runs in (drive(plain, arrivals=STREAM_ARRIVALS), drive(streamed, arrivals=STREAM_ARRIVALS)):
        assert [r.shape for r in runs] == [r.shape for r in want]
        for got, ref in zip(runs, want, strict=True):
            assert got.sampled == ref.sampled
            assert (got.logits is None) == (ref.logits is None)
            assert got.logits is None or torch.equal(got.logits, ref.logits)
    assert not streams.pending
    inline = [r for r in want if set(r.encodes) & {rid for rid, _, _ in r.prefills}]
    if policy == Policy.STAGE:  # independent encodes overlapped the LLM
        assert streams.overlapped >= 1 and not inline
    else:  # every encode was inline: a request's own chunk needed its features at once
        assert inline and streams.overlapped == 0


# -- on a GPU, for real ----------------------------------------------------------------------------


@needs_flash
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (8, 1, 64), (32, 8, 128)])
def test_flash_attn_matches_the_reference(dtype, heads, kv_heads, dim):
    """Not measured here (no GPU): outputs are O(1) and both accumulate in float32, so they should
    differ by about one half-precision ulp (bf16 2^-7 at 1), plus flash's rounding of P to 16 bits."""
    q, k, v, cu_q, cu_k = (t.cuda() for t in packed(MIXED, heads, kv_heads, dim))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    args = (q, k, v, cu_q, cu_k, 16, 40)
    got = flash_attn_varlen_func(*args, causal=True)
    torch.testing.assert_close(got, varlen_attention_reference(*args, causal=True), atol=2e-2, rtol=2e-2)


@needs_flash
def test_cuda_engine_flash_path_matches_the_reference_kernel(make_engine, float32_sdpa_runs):
    """The production path (bf16, flash-attn, the vision stream): its metadata as on CPU, its
    first-token logits close to the reference kernel's on the same GPU and to CPU float32's. With
    torch's decoder ops: the fused ones give the varlen call the prefill chunks alone."""
    kw = {"token_budget": BUDGET, "device": "cuda", "gpu_memory_fraction": 0.1, "kernels": "torch"}
    real = drive(make_engine(**kw))
    reference = drive(make_engine(**kw), flash=True)
    assert [r.shape for r in real] == [r.shape for r in reference]
    for run in real:
        if run.meta is not None:
            check_flash_metadata(run, 16, flash_attn_varlen_func)
    want = {rid: t.cpu() for rid, t in first_logits(reference).items()}
    got = {rid: t.cpu() for rid, t in first_logits(real).items()}
    assert_close_to_float32(got, want, "flash-attn vs reference, bf16")
    assert_close_to_float32(want, first_logits(float32_sdpa_runs), "CUDA bf16 vs CPU f32")


@needs_flash
def test_cuda_vision_stream_gives_the_serial_result(make_engine):
    kw = {"token_budget": BUDGET, "device": "cuda", "gpu_memory_fraction": 0.1}
    overlapped = make_engine(**kw)
    assert overlapped.runner.vision_stream is not None
    serial = make_engine(**kw)
    serial.runner.vision_stream = None
    a, b = drive(overlapped, arrivals=STREAM_ARRIVALS), drive(serial, arrivals=STREAM_ARRIVALS)
    assert [r.shape for r in a] == [r.shape for r in b]
    for x, y in zip(a, b, strict=True):
        assert x.sampled == y.sampled
        if x.logits is not None:  # a race reads stale or unwritten memory: far off, or NaN
            torch.testing.assert_close(x.logits, y.logits, atol=1e-2, rtol=0)


@needs_cuda
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_captured_decode_steps_give_the_uncaptured_padded_tokens(make_engine, batch):
    """CUDA graphs replay exactly the padded step: greedy tokens equal to the same steps run
    uncaptured, with a graph captured for each bucket used."""
    kw = {"device": "cuda", "gpu_memory_fraction": 0.1}
    got = []
    for mode in ("auto", "eager"):
        engine = make_engine(decode_graphs=mode, **kw)
        prompts = [engine.chat_prompt(QUESTIONS[i % 4], 0) for i in range(batch)]
        done = engine.generate(prompts, [[]] * batch, SamplingParams(max_tokens=16 + 4 * batch))
        got.append([c.token_ids for c in done])
        graphs = engine.runner.graphs
        assert graphs.runs > 0 and graphs.capture == (mode == "auto")
        assert all((step.graph is not None) == graphs.capture for step in graphs.steps.values())
    assert got[0] == got[1]


@needs_cuda
@pytest.mark.parametrize("source", ["host", "device"])
def test_kv_landed_from_another_thread_is_whole_for_the_engines_stream(source):
    """Decode's pulls write a request's KV into its blocks on a copier thread (kv_landing.py),
    from host memory (streamed) or a GPU (CUDA IPC), each on that thread's current stream. Once
    `write` returns the bytes are there for any stream: the engine reads them on its own."""
    import threading

    from common.engine.kv_cache import KVCache, KVSpec
    from common.engine.kv_landing import KvLanding

    cache = KVCache(KVSpec(4, 8, 128, 16, torch.bfloat16), num_blocks=512, device="cuda")
    ids = torch.randperm(512)[:256].tolist()
    buffer = torch.randn(4, 2, 256, 16, 8, 128, dtype=torch.bfloat16)
    if source == "device":
        buffer = buffer.cuda()
    landing = KvLanding("r", cache, ids)

    def on_a_side_stream() -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            landing.write(0, buffer)

    writer = threading.Thread(target=on_a_side_stream)
    writer.start()
    writer.join()
    with torch.cuda.stream(torch.cuda.Stream()):  # the engine's: unaware of the writer's
        read = cache.export_blocks(ids, range(4)).cpu()
    assert torch.equal(read, buffer.cpu())
