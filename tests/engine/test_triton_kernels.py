"""The Triton kernels (triton_ops.py, triton_attention.py) against their references (decoder_ops.py,
paged_decode.py), argument for argument.

On a GPU they run compiled, and also inside a captured CUDA graph whose inputs change between
replays. Where Triton is installed without a GPU they run under Triton's interpreter
(TRITON_INTERPRET=1: the same kernel code, in numpy on the CPU). CPU torch ships without Triton,
so `make test` skips them (the references' own tests, test_decoder_ops.py, carry the contract
there); `make test-kernels` (CI's second step) installs Triton beside the venv and runs them
interpreted, and bench/gpu_check.py runs this file on the GPU.

Tolerances: RoPE with the KV write keeps the eager path's bits (it rounds where eager rounds and
fuses no multiply-add). The norm and SiLU differ from torch's by their reduction order and exp:
float32 within 4 ulps, half precision within one rounding of the output. Attention sums in
another order than the reference (tiles, splits): float32 within 2e-5 of O(1) outputs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

from common.engine import op_checks
from common.engine.decoder_ops import (
    Shapes,
    add_rms_norm_reference,
    rotary_kv_write_reference,
    silu_mul_reference,
)
from common.engine.paged_decode import paged_decode_reference
from common.engine.sampling import SamplingParams

CUDA = torch.cuda.is_available()
# The interpreter casts float32 to bfloat16 by truncating (a GPU rounds to nearest even) and its
# bf16 tl.dot is wrong (numpy has no bf16): bit-level half-precision checks use float16 there.
HALF = torch.bfloat16 if CUDA else torch.float16
KERNEL_MODULES = ("common.engine.triton_ops", "common.engine.triton_attention")
# Tiny-llava's, an MQA model's with 4-token blocks, LLaVA-7B's and Qwen2-VL-7B's (GQA 7:1).
SHAPES = [
    Shapes(64, 176, 4, 2, 16, 16),
    Shapes(96, 200, 6, 1, 32, 4),
    Shapes(4096, 11008, 32, 32, 128, 16),
    Shapes(3584, 18944, 28, 4, 128, 16),
]


def _interpretable_on_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a one-element array into an index with int(), which NumPy
    2.4 refuses for arrays of one dimension; give it the element."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "one_element_index", False):
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.one_element_index = True
    interpreter._patch_lang_tensor = patched


def _cannot_run(why: str) -> None:
    """Skip, except in `make test-kernels` (TRIDENT_REQUIRE_TRITON=1), whose only purpose is to run them."""
    if os.environ.get("TRIDENT_REQUIRE_TRITON") == "1":
        pytest.fail(f"make test-kernels: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def kernels():
    """(triton_ops, triton_attention, device): compiled on CUDA, else interpreted on the CPU."""
    if CUDA:
        yield (*(importlib.import_module(m) for m in KERNEL_MODULES), torch.device("cuda"))
        return
    if importlib.util.find_spec("triton") is None:
        _cannot_run("Triton is not installed (CPU torch ships without it); the GPU check runs these on CUDA")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # Its own jit'd library (tl.sum, ...) was decorated for compiling: interpreting needs it anew.
        _cannot_run("Triton was imported before TRITON_INTERPRET=1 was set: run with it set")
    before = {m: sys.modules.pop(m, None) for m in KERNEL_MODULES}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # read as kernels are decorated, and as they call helpers
        _interpretable_on_numpy_2_4()
        modules = [importlib.import_module(m) for m in KERNEL_MODULES]
        yield (*modules, torch.device("cpu"))
    for name, module in before.items():  # later imports get compiled kernels again
        sys.modules.pop(name, None)
        if module is not None:
            sys.modules[name] = module


@pytest.mark.parametrize(
    "shapes", SHAPES, ids=lambda s: f"h{s.hidden}-q{s.heads}-kv{s.kv_heads}-d{s.head_dim}"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_each_kernel_passes_the_check_it_is_selected_by(kernels, shapes, dtype):
    """What `select_ops` runs at load, on every shape class the presets have."""
    triton_ops, triton_attention, device = kernels
    for name, kernel in (
        ("add_rms_norm", triton_ops.add_rms_norm),
        ("rotary_kv_write", triton_ops.rotary_kv_write),
        ("silu_mul", triton_ops.silu_mul),
        ("paged_decode", triton_attention.paged_decode),
    ):
        if name == "paged_decode" and dtype == torch.bfloat16 and not CUDA:
            continue  # the interpreter's bf16 tl.dot returns garbage (numpy has no bf16); on CUDA it runs
        op_checks.CHECKS[name](kernel, device, dtype, shapes)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of the output dtype's rounding at each value's size."""
    spacing = torch.finfo(want.dtype).eps * want.float().abs().clamp(min=torch.finfo(want.dtype).tiny)
    return ((got.float() - want.float()).abs() / spacing).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=str)
def test_rotary_kv_write_keeps_the_eager_bits(kernels, dtype):
    triton_ops, _, device = kernels
    tokens, heads, kv_heads, dim = 9, 28, 4, 128
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    cos, sin = op_checks._cos_sin(tokens, dim, device, dtype)
    slots = torch.randperm(64, generator=gen)[:tokens].to(device)
    caches = [torch.zeros(64, kv_heads, dim, device=device, dtype=dtype) for _ in range(4)]
    got = triton_ops.rotary_kv_write(q, k, v, cos, sin, caches[0], caches[1], slots)
    want = rotary_kv_write_reference(q, k, v, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=str)
def test_norm_and_swiglu_are_within_rounding_of_the_eager_ops(kernels, dtype):
    triton_ops, _, device = kernels
    gen = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(7, 3584, generator=gen).to(device, dtype) for _ in range(2))
    weight = torch.randn(3584, generator=gen).to(device, dtype)
    normed, summed = triton_ops.add_rms_norm(x, delta, weight, 1e-6)
    want_normed, want_summed = add_rms_norm_reference(x, delta, weight, 1e-6)
    assert torch.equal(summed, want_summed), "the residual stream is the eager add's"
    gate_up = torch.randn(7, 2 * 1000, generator=gen).to(device, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    silu = triton_ops.silu_mul(gate, up)
    bound = 4.0 if dtype == torch.float32 else 1.0
    for name, got, want in (("norm", normed, want_normed), ("silu", silu, silu_mul_reference(gate, up))):
        print(f"{name} {dtype}: {_ulps(got, want):.2f} ulps")
        assert _ulps(got, want) <= bound + 1e-6, name


@pytest.mark.parametrize("splits", [None, 1, 2, 3, 7])
def test_paged_decode_splits_merge_to_the_reference(kernels, splits):
    """Long and short contexts in one batch, tables padded to 24 blocks: every split count (some
    splits empty for the short rows) gives the reference's output."""
    _, triton_attention, device = kernels
    gen = torch.Generator().manual_seed(2)
    bs, heads, kv_heads, dim = 16, 8, 2, 64
    k_cache = torch.randn(48 * bs, kv_heads, dim, generator=gen).to(device)
    v_cache = torch.randn(48 * bs, kv_heads, dim, generator=gen).to(device)
    tables = torch.randint(0, 48, (4, 24), generator=gen, dtype=torch.int32).to(device)
    lengths = torch.tensor([384, 1, 200, 17], dtype=torch.int32).to(device)
    q = torch.randn(4, heads, dim, generator=gen).to(device)
    got = triton_attention.paged_decode(q, k_cache, v_cache, tables, lengths, bs, splits=splits)
    want = paged_decode_reference(q, k_cache, v_cache, tables, lengths, bs)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: graph capture")
def test_kernels_replay_from_a_captured_graph_with_new_metadata(kernels):
    """The decode attention as decode_graphs.py captures it: tables and lengths in fixed buffers,
    written before each replay; the replay reads the new ones (nothing was read to the host)."""
    _, triton_attention, device = kernels
    gen = torch.Generator().manual_seed(3)
    bs, heads, kv_heads, dim, batch = 16, 8, 2, 128, 4
    kv = torch.randn(2, 40 * bs, kv_heads, dim, generator=gen).to(device, torch.bfloat16)
    tables = torch.zeros(batch, 8, dtype=torch.int32, device=device)
    lengths = torch.ones(batch, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, dim, generator=gen).to(device, torch.bfloat16)

    def step() -> torch.Tensor:
        return triton_attention.paged_decode(q, kv[0], kv[1], tables, lengths, bs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        g = torch.Generator().manual_seed(10 + seed)
        tables.copy_(torch.randint(0, 40, tables.shape, generator=g, dtype=torch.int32))
        lengths.copy_(torch.randint(1, 8 * bs + 1, lengths.shape, generator=g, dtype=torch.int32))
        graph.replay()
        want = paged_decode_reference(q, kv[0], kv[1], tables, lengths, bs)
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: the engine's CUDA path")
@pytest.mark.parametrize("decode_graphs", ["auto", "off"])
def test_a_float32_cuda_engine_gives_the_eager_tokens_through_the_kernels(make_engine, decode_graphs):
    """Triton's kernels selected at load (none fell back), captured in graphs or eager: the greedy
    tokens of the eager torch ops on the same GPU, in float32."""
    kw = {"device": "cuda", "dtype": "float32", "gpu_memory_fraction": 0.1, "decode_graphs": decode_graphs}
    got = []
    for kernels in ("auto", "torch"):
        engine = make_engine(kernels=kernels, **kw)
        ops = engine.model.language_model.ops
        if kernels == "auto":
            assert ops is not None and not ops.fallbacks, ops and ops.fallbacks
        else:
            assert ops is None
        prompts = [engine.chat_prompt(f"Question {i}: what now?", 0) for i in range(5)]
        got.append([c.token_ids for c in engine.generate(prompts, [[]] * 5, SamplingParams(max_tokens=24))])
    assert got[0] == got[1]
