"""The CUDA decoder's fused ops and in-place decode attention (decoder_ops.py, paged_decode.py), by
their contracts on the CPU.

- The references state each op with the eager path's numbers: the same bits as the ops they
  replace, in float32 and bfloat16.
- The paged decode reference attends over exactly each decode's context (scattered blocks, a
  shared first block, a partly filled last block, padded tables) and refuses what a kernel cannot
  take.
- `REFERENCE_OPS` set on a CPU engine drives the fused path — the residual stream carried beside
  each layer, RoPE with the KV write, decode attention through block tables and lengths, in
  mixed batches and in the padded CUDA-graph steps — and every answer is HF's, or for the other
  families the eager path's (itself HF's, test_parity*.py).
- Selection: the eager ops on a CPU and with `GpuKernels.TORCH`; on CUDA a kernel that fails its
  check falls back and says why.

The Triton kernels themselves are checked against these references in test_triton_kernels.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from common.checkpoints import write_checkpoint
from common.engine import op_checks
from common.engine.config import EngineConfig, GpuKernels
from common.engine.decoder_ops import (
    REFERENCE_OPS,
    DecoderOps,
    Shapes,
    add_rms_norm_reference,
    rotary_kv_write_reference,
    silu_mul_reference,
)
from common.engine.models.llama import MLP, RMSNorm, apply_rotary
from common.engine.paged_decode import flash_pages_fit, paged_decode_reference
from common.engine.sampling import SamplingParams
from tests.helpers.attention import reference as varlen_reference
from tests.helpers.engine import QUESTIONS, check_mixed_batch, engines
from tests.helpers.images import make_image

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- the references: the eager path's bits ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_reference_is_the_eager_add_then_norm(dtype):
    norm = RMSNorm(48, 1e-5).to(dtype)
    norm.weight.data = randn(48, seed=1, dtype=dtype)
    x, delta = randn(7, 48, seed=2, dtype=dtype), randn(7, 48, seed=3, dtype=dtype)
    normed, summed = add_rms_norm_reference(x, delta, norm.weight, norm.eps)
    assert torch.equal(summed, x + delta) and torch.equal(normed, norm.forward(x + delta))
    normed, summed = add_rms_norm_reference(x, None, norm.weight, norm.eps)
    assert summed is x and torch.equal(normed, norm.forward(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kv_write_reference_turns_and_writes_as_the_eager_path(dtype):
    """q/k/v as views of one product (the GPU's stacked projection); the eager path turns q and k
    with apply_rotary and writes k and v with index_copy_."""
    heads, kv_heads, dim, tokens = 6, 2, 16, 5
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, seed=4, dtype=dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    cos, sin = op_checks._cos_sin(tokens, dim, torch.device("cpu"), dtype)
    slots = torch.tensor([9, 2, 30, 17, 5])
    got_k, got_v, want_k, want_v = (torch.zeros(32, kv_heads, dim, dtype=dtype) for _ in range(4))
    got = rotary_kv_write_reference(q, k, v, cos, sin, got_k, got_v, slots)
    want_k.index_copy_(0, slots, apply_rotary(k, cos, sin))
    want_v.index_copy_(0, slots, v)
    assert torch.equal(got, apply_rotary(q, cos, sin))
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_reference_is_the_eager_swiglu(dtype):
    mlp = MLP(32, 40, bias=False).to(dtype)
    x = randn(6, 32, seed=5, dtype=dtype)
    gate, up = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
    assert torch.equal(mlp.down_proj.forward(silu_mul_reference(gate, up)), mlp.forward(x))
    assert torch.equal(silu_mul_reference(gate, up), F.silu(gate) * up)


# -- the paged decode reference ------------------------------------------------------------------

BS, HEADS, KV_HEADS, DIM = 4, 6, 2, 16
# Scattered blocks, a shared first block (3), a partly filled last block, a table padded past its
# context with another block (the graphs' scratch), one token of context.
TABLES = [[3, 7, 1, 11], [3, 4, 5, 12], [10, 12, 12, 12], [2, 8, 9, 6]]
LENGTHS = [16, 9, 1, 10]


def paged_inputs(seed: int = 0):
    k_cache, v_cache = randn(13 * BS, KV_HEADS, DIM, seed=seed), randn(13 * BS, KV_HEADS, DIM, seed=seed + 1)
    q = randn(len(TABLES), HEADS, DIM, seed=seed + 2)
    return (
        q,
        k_cache,
        v_cache,
        torch.tensor(TABLES, dtype=torch.int32),
        torch.tensor(LENGTHS, dtype=torch.int32),
    )


def test_paged_decode_reference_attends_over_exactly_each_context():
    q, k_cache, v_cache, tables, lengths = paged_inputs()
    got = paged_decode_reference(q, k_cache, v_cache, tables, lengths, BS)
    want = varlen_reference(q, k_cache, v_cache, TABLES, LENGTHS)  # slot by slot, flash-attn's semantics
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    moved = k_cache.clone()
    moved[12 * BS :] += 5.0  # block 12 only pads tables, past their contexts
    moved[9 * BS + 3] += 5.0  # in decode 3's partly filled last block (2 of 4 slots), past its context
    moved[1 * BS + 2] += 5.0  # inside decode 0's context
    again = paged_decode_reference(q, moved, v_cache, tables, lengths, BS)
    assert torch.equal(again[1:], got[1:]) and not torch.allclose(again[0], got[0])


def test_paged_decode_reference_rejects_what_a_kernel_cannot_take():
    q, k_cache, v_cache, tables, lengths = paged_inputs()
    bad = [
        ((q, k_cache, v_cache, tables.float(), lengths, BS), "integer"),
        ((q, k_cache, v_cache, tables, torch.tensor([16, 9, 0, 10]), BS), "lengths must be 1"),
        ((q, k_cache, v_cache, tables, torch.tensor([17, 9, 1, 10]), BS), "lengths must be 1"),
        ((q, k_cache, v_cache, tables + 13, lengths, BS), "outside the cache"),
        ((q[:, :5], k_cache, v_cache, tables, lengths, BS), "multiple"),
        ((q, k_cache[:-1], v_cache[:-1], tables, lengths, BS), "whole blocks"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            paged_decode_reference(*args)


def test_flash_attn_pages_fit_only_multiples_of_256_in_half_precision():
    assert not flash_pages_fit(16, torch.bfloat16), "the engine's default blocks: Triton's kernel instead"
    assert flash_pages_fit(256, torch.bfloat16) and flash_pages_fit(512, torch.float16)
    assert not flash_pages_fit(256, torch.float32)


# -- the fused path through an engine ------------------------------------------------------------


def counting(ops: DecoderOps) -> tuple[DecoderOps, dict[str, int]]:
    """`ops` with each call counted, and the decode attention's batches recorded."""
    calls = dict.fromkeys(("add_rms_norm", "rotary_kv_write", "silu_mul", "paged_decode"), 0)
    seen: list[tuple[int, int, int]] = []  # (rows, table width, longest context)

    def counted(name):
        fn = getattr(ops, name)

        def run(*args, **kwargs):
            calls[name] += 1
            if name == "paged_decode":
                q, _, _, tables, lengths, _ = args
                seen.append((len(q), tables.shape[1], int(lengths.max())))
            return fn(*args, **kwargs)

        return run

    fields = {name: counted(name) for name in calls}
    calls["batches"] = seen
    return dataclasses.replace(ops, **fields), calls


def with_reference_ops(engine, fuse: bool = False) -> dict:
    lm = engine.model.language_model
    if fuse:  # as the loader stacks them on a GPU: q/k/v and gate/up are views of one product
        lm.fuse_projections()
    ops, calls = counting(REFERENCE_OPS)
    lm.set_ops(ops)
    return calls


@pytest.mark.parametrize(("decode_graphs", "prefix_caching"), [("off", False), ("eager", True)])
def test_the_fused_path_answers_as_hf_in_mixed_batches(
    make_engine, hf_generate, images, decode_graphs, prefix_caching
):
    """Eight requests of different lengths and images in flight at once, 4-token blocks: steps mix
    prefill chunks and decodes, each decode reads its own table (the prompt's cached blocks shared
    under prefix caching), mostly ending inside a block; `eager` runs the decode-only steps padded
    to buckets from fixed buffers, as the CUDA graphs replay them."""
    engine = make_engine(block_size=4, prefix_caching=prefix_caching, decode_graphs=decode_graphs)
    calls = with_reference_ops(engine)
    steps = []
    forward = engine.runner.forward

    def recorded(prefills, decodes):
        steps.append((len(prefills), len(decodes)))
        return forward(prefills, decodes)

    engine.runner.forward = recorded
    check_mixed_batch(engine, hf_generate, QUESTIONS, images, stride=2)
    layers, llm_steps = engine.kv_spec.num_layers, sum(1 for p, d in steps if p or d)
    assert calls["rotary_kv_write"] == calls["silu_mul"] == layers * llm_steps
    assert calls["add_rms_norm"] == (2 * layers + 1) * llm_steps
    assert calls["paged_decode"] == layers * sum(1 for _, d in steps if d)
    assert any(p and d for p, d in steps), "no step mixed prefill chunks and decodes"
    batches = calls["batches"]
    assert max(rows for rows, _, _ in batches) >= 4 and any(ctx % 4 for _, _, ctx in batches)
    if decode_graphs == "eager":  # padded: rows and table widths past the batch's own
        assert engine.runner.graphs.runs > 0 and any(width * 4 >= ctx + 4 for _, width, ctx in batches)
    assert (engine.blocks.hit_tokens > 0) == prefix_caching, "requests share the chat template's blocks"


def test_the_fused_path_with_stacked_projections_answers_as_hf(make_engine, hf_generate, images):
    """As on a GPU: q/k/v and gate/up are strided views of one product each, and the ops take them so."""
    engine = make_engine(token_budget=16, decode_graphs="eager")
    calls = with_reference_ops(engine, fuse=True)
    for n in (0, 2):
        prompt = engine.chat_prompt(QUESTIONS[n], n)
        (got,) = engine.generate([prompt], [images[:n]], SamplingParams(max_tokens=16))
        assert got.token_ids == hf_generate(prompt, images[:n], 16)
    assert calls["paged_decode"] > 0 and calls["rotary_kv_write"] > 0


FAMILIES = ["tiny-llava-next", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ops") / request.param, request.param, seed=0)


def test_every_family_gives_the_eager_tokens_through_the_fused_path(family_dir):
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms, M-RoPE and DeepStack, LLaVA-NeXT's tiles:
    stacked projections and reference ops give the eager path's tokens (which are HF's)."""
    with engines(family_dir) as build:
        engine = build(token_budget=48, decode_graphs="eager", prefix_caching=False)
        prompts = [engine.chat_prompt(f"Question {i}: what do you see?", i % 3) for i in range(4)]
        pictures = [[make_image(5 * i + k) for k in range(i % 3)] for i in range(4)]
        params = SamplingParams(max_tokens=10)
        eager = [c.token_ids for c in engine.generate(prompts, pictures, params)]
        calls = with_reference_ops(engine, fuse=True)
        assert [c.token_ids for c in engine.generate(prompts, pictures, params)] == eager
        assert calls["paged_decode"] > 0


# -- which ops an engine runs --------------------------------------------------------------------


def test_a_cpu_engine_runs_the_eager_ops(make_engine):
    assert make_engine().model.language_model.ops is None
    assert EngineConfig(kernels="torch").kernels is GpuKernels.TORCH
    with pytest.raises(ValueError, match="kernels must be one of auto, torch"):
        EngineConfig(kernels="fast")
    shapes = Shapes(64, 176, 4, 2, 16, 16)
    assert op_checks.select_ops(GpuKernels.AUTO, torch.device("cpu"), torch.float32, shapes) is None
    assert op_checks.select_ops(GpuKernels.TORCH, torch.device("cuda"), torch.bfloat16, shapes) is None


def test_a_kernel_that_fails_its_check_falls_back_and_says_why():
    """The check compares with the reference on the model's shapes: a kernel that raises (a
    compile error) or answers wrong is replaced — by the reference, or the gather path for the
    decode attention — and the reason is kept; a later candidate is tried first."""
    shapes, cpu = Shapes(64, 176, 4, 2, 16, 16), torch.device("cpu")

    def broken_compile(*args, **kwargs):
        raise RuntimeError("triton.compiler.errors.CompilationError: at 12:4")

    def wrong_norm(x, delta, weight, eps):
        normed, summed = add_rms_norm_reference(x, delta, weight, eps)
        return normed * 1.1, summed

    def off_by_one_decode(q, k_cache, v_cache, tables, lengths, block_size):
        return paged_decode_reference(q, k_cache, v_cache, tables, (lengths - 1).clamp(min=1), block_size)

    ops = op_checks.checked(
        {
            "add_rms_norm": [("triton", wrong_norm)],
            "rotary_kv_write": [("triton", broken_compile), ("second", rotary_kv_write_reference)],
            "silu_mul": [("triton", silu_mul_reference)],
            "paged_decode": [("triton", off_by_one_decode)],
        },
        cpu, torch.float32, shapes,
    )  # fmt: skip
    assert ops.add_rms_norm is add_rms_norm_reference and "not close" in ops.fallbacks["add_rms_norm"]
    assert (
        ops.rotary_kv_write is rotary_kv_write_reference
        and "CompilationError" in ops.fallbacks["rotary_kv_write"]
    )
    assert ops.paged_decode is None and "paged_decode" in ops.fallbacks["paged_decode"]
    assert ops.names == {
        "add_rms_norm": "torch",
        "rotary_kv_write": "second",
        "silu_mul": "triton",
        "paged_decode": "gather",
    }
    assert "silu_mul" not in ops.fallbacks
