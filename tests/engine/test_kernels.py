"""minimill's compiled CPU kernels against the portable PyTorch reference, op by op on random
inputs (float32 and bfloat16, several shapes), then whole engines (float32: greedy tokens
identical, logits close) on decodes, prompt chunks, mixed steps, preemption and resume."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from engine_helpers import PROMPTS

from minimill.engine.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    build_metadata,
    layer_views,
)
from minimill.engine.kernels import CpuKernels, TorchKernels, select_kernels
from minimill.engine.llm import LLM
from minimill.engine.native import load_cpu_kernels
from minimill.engine.params import SamplingParams
from minimill.models.types import LoadedModel

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def native() -> CpuKernels:
    state = load_cpu_kernels()
    assert state.available, state.reason
    return CpuKernels()


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    scale = max(1.0, float(b.float().abs().max()))
    assert float((a.float() - b.float()).abs().max()) <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activation_match_the_reference(native: CpuKernels,
                                                  dtype: torch.dtype) -> None:
    reference = TorchKernels()
    g = torch.Generator().manual_seed(0)
    for rows, width in ((1, 576), (37, 576), (300, 4096), (5, 100)):
        x = torch.randn(rows, width, generator=g).to(dtype)
        residual = torch.randn(rows, width, generator=g).to(dtype)
        weight = torch.randn(width, generator=g).to(dtype)
        close(native.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), dtype)
        want = reference.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
        got = native.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
        close(got[0], want[0], dtype)
        close(got[1], want[1], dtype)
        gate_up = torch.randn(rows, 2 * width, generator=g).to(dtype)
        close(native.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), dtype)


@dataclass
class AttentionCase:
    kv: torch.Tensor
    qkv: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    meta: AttentionMetadata


def attention_case(dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int,
                   head_dim: int, block_size: int, query_lens: list[int], cached: list[int],
                   seed: int) -> AttentionCase:
    """A KV pool with random earlier context, and a step of new tokens for each sequence."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, cached, strict=True)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    kv = allocate_kv_cache(num_blocks, 2, kv_heads, block_size, head_dim, kv_dtype, CPU)
    if kv_dtype == torch.int8:  # random values and zero points, then valid positive scales
        kv.copy_(torch.randint(-128, 128, kv.shape, generator=g, dtype=torch.int8))
        scales = kv[..., -3 * block_size:-block_size].view(torch.float16)
        scales.copy_(torch.rand(scales.shape, generator=g) * 0.05 + 0.001)
    else:
        kv.copy_(torch.randn(kv.shape, generator=g).to(dtype))
    tokens = sum(query_lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, cached,
                                                                    strict=True)])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max(seq_lens) + 1).float()[:, None] * inv_freq[None]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], 1).contiguous()
    meta = build_metadata(query_lens, seq_lens, tables, block_size, CPU)
    return AttentionCase(kv, qkv, positions, cos_sin, meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_cache", [False, True], ids=["model-dtype-kv", "int8-kv"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
    (9, 3, 64, 16),  # SmolLM2: 3 query heads per kv head
    (8, 8, 128, 32),  # no GQA, larger heads and blocks
    (28, 4, 128, 16),  # Qwen2.5-7B's grouping
])
def test_rotary_kv_write_and_paged_attention_match_the_reference(
        native: CpuKernels, dtype: torch.dtype, int8_cache: bool, heads: int, kv_heads: int,
        head_dim: int, block_size: int) -> None:
    reference = TorchKernels()
    # Decodes, prompt chunks with and without earlier context, one longer than a key part.
    query_lens, cached = [1, 1, 5, 40, 1, 17, 300, 3], [10, 100, 0, 7, 63, 33, 20, 600]
    kv_dtype = torch.int8 if int8_cache else dtype
    case = attention_case(dtype, kv_dtype, heads, kv_heads, head_dim, block_size, query_lens,
                          cached, 1)
    kv_native = case.kv.clone()
    k_ref, v_ref = layer_views(case.kv, 1)
    k_nat, v_nat = layer_views(kv_native, 1)
    slots = case.meta.slot_mapping
    q_ref = reference.rotary_kv_write(case.qkv, case.positions, case.cos_sin, k_ref, v_ref,
                                      slots, heads, kv_heads, block_size)
    q_nat = native.rotary_kv_write(case.qkv, case.positions, case.cos_sin, k_nat, v_nat,
                                   slots, heads, kv_heads, block_size)
    close(q_nat, q_ref, dtype)
    if int8_cache:  # the same slots, layout, scales and zero points; a value may round the
        # other way
        assert (kv_native.float() - case.kv.float()).abs().max() <= 1
        assert torch.equal(kv_native[..., -3 * block_size:], case.kv[..., -3 * block_size:])
    else:  # the same slots, the same layout
        close(kv_native, case.kv, dtype)
    scale = head_dim ** -0.5
    want = reference.paged_attention(q_ref, k_ref, v_ref, case.meta, scale)
    got = native.paged_attention(q_ref, k_ref, v_ref, case.meta, scale)
    close(got, want, dtype)


def test_kernel_choice_says_why(native: CpuKernels) -> None:
    kernels, why = select_kernels("auto", CPU, torch.float32, 16, 64)
    assert isinstance(kernels, CpuKernels)
    kernels, why = select_kernels("auto", CPU, torch.float16, 16, 64)
    assert type(kernels) is TorchKernels and "float16" in why
    kernels, why = select_kernels("auto", CPU, torch.float32, 8, 64)
    assert type(kernels) is TorchKernels and "block_size" in why
    with pytest.raises(ValueError, match="cannot be used"):
        select_kernels("native", CPU, torch.float32, 8, 64)
    kernels, _ = select_kernels("torch", CPU, torch.float32, 16, 64)
    assert type(kernels) is TorchKernels


@pytest.fixture(scope="module")
def reference_llm(smol_f32: LoadedModel) -> LLM:
    return LLM(smol_f32, dtype="float32", kernels="torch", num_kv_blocks=1024,
               max_model_len=2048)


def test_engines_agree_on_decodes_chunks_and_mixed_steps(llm: LLM, reference_llm: LLM) -> None:
    assert llm.engine.runner.kernels.name == "native-cpu"
    assert reference_llm.engine.runner.kernels.name == "torch"
    tok = llm.tokenizer
    # Different lengths: early prompts decode while later ones are still being prefilled.
    prompts = [tok.encode(p * (1 + i % 3), add_special_tokens=True)
               for i, p in enumerate(PROMPTS * 3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, top_logprobs=3)
    for chunk in (2048, 24):
        fast = LLM(llm.engine.loaded, dtype="float32", max_num_batched_tokens=chunk,
                   max_num_seqs=12, num_kv_blocks=512)
        slow = LLM(reference_llm.engine.loaded, dtype="float32", kernels="torch",
                   max_num_batched_tokens=chunk, max_num_seqs=12, num_kv_blocks=512)
        for a, b in zip(fast.generate(prompts, params), slow.generate(prompts, params),
                        strict=True):
            assert a.output_token_ids == b.output_token_ids
            assert a.logprobs is not None and b.logprobs is not None
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert abs(x.logprob - y.logprob) < 1e-3


def test_engines_agree_through_preemption_and_resume(smol_f32: LoadedModel) -> None:
    tok_prompts = [smol_f32.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = {}
    for kernels in ("native", "torch"):
        # Too few blocks for all four at once: some are preempted and recomputed.
        tight = LLM(smol_f32, dtype="float32", kernels=kernels, num_kv_blocks=10,
                    enable_prefix_caching=False)
        full = tight.generate(tok_prompts, params)
        assert tight.engine.scheduler.num_preemptions > 0
        resumed = tight.generate(tok_prompts, params,
                                 resume_token_ids=[o.output_token_ids[:13] for o in full])
        outs[kernels] = ([o.output_token_ids for o in full],
                         [o.output_token_ids for o in resumed])
    assert outs["native"] == outs["torch"]
    assert outs["native"][0] == outs["native"][1]


def test_int8_quantization_error_is_within_half_a_step() -> None:
    from minimill.engine.attention import quantize_int8

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, 3, 64, generator=g) * torch.rand(1000, 3, 1, generator=g) * 10
    x[0, 0] = 0.0  # an all-zero vector keeps a usable scale
    x[1] = x[1].abs() + 1  # all positive: the range still holds 0, the zero point fits
    x[2, :, 0] = -40.0  # lopsided: one large negative outlier
    values, scales, zeros = quantize_int8(x)
    assert values.dtype == zeros.dtype == torch.int8 and scales.dtype == torch.float16
    restored = (values.float() - zeros.float()[..., None]) * scales.float()[..., None]
    step = scales.float()[..., None]
    assert ((restored - x).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(restored[0, 0], torch.zeros(64))
    # The error relative to a vector's span (with 0) is at most 1/510 (+ float16 rounding).
    span = x.amax(-1).clamp(min=0) - x.amin(-1).clamp(max=0)
    worst = ((restored - x).abs().amax(-1) / span.clamp(min=1e-9)).max()
    assert worst < 1 / 510 + 1e-3
    # Asymmetric: a lopsided vector gets a finer step than max|x| / 127 would give.
    assert (step[2, :, 0] < x[2].abs().amax(-1) / 127 * 0.75).all()


def test_int8_kv_engines_agree_and_resume_exactly(smol_f32: LoadedModel) -> None:
    prompts = [smol_f32.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, top_logprobs=2)
    runs = {}
    for kernels in ("native", "torch"):
        engine = LLM(smol_f32, dtype="float32", kv_dtype="int8", kernels=kernels,
                     num_kv_blocks=256)
        assert engine.engine.runner.kv_cache.dtype == torch.int8
        runs[kernels] = engine.generate(prompts, params)
    # Rotary in C++ and in PyTorch may differ in the last bit, so a value may be quantized one
    # step apart: the runs agree up to a near tie, never on a clear choice.
    agreed = 0
    for a, b in zip(runs["native"], runs["torch"], strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        for i, (x, y) in enumerate(zip(a.output_token_ids, b.output_token_ids, strict=True)):
            (best, best_lp), (_, second_lp) = a.logprobs[i].top
            assert abs(best_lp - dict(b.logprobs[i].top).get(best, -99.0)) < 0.1
            if x != y:
                assert best_lp - second_lp < 0.02, (i, a.logprobs[i].top, b.logprobs[i].top)
                break
        else:
            agreed += 1
    assert agreed >= len(prompts) // 2
    # Batch-invariant with int8 KV too: resumed requests continue bit for bit.
    engine = LLM(smol_f32, dtype="float32", kv_dtype="int8", num_kv_blocks=256)
    full = runs["native"]
    resumed = engine.generate(prompts, params,
                              resume_token_ids=[o.output_token_ids[:9] for o in full])
    for a, b in zip(resumed, full, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.logprobs is not None and b.logprobs is not None
        assert [x.top for x in a.logprobs] == [x.top for x in b.logprobs[9:]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 1728), (576, 3072), (1536, 576), (576, 49152)])
def test_a_rows_gemm_result_does_not_depend_on_the_batch(native: CpuKernels, dtype: torch.dtype,
                                                         shape: tuple[int, int]) -> None:
    """Each row of `linear` comes out the same alone, in a small batch, in a tall prompt chunk,
    at any place in it and on one thread or two (SmolLM2's weight shapes; where the CPU has
    AMX, oneDNN's bf16 reduction order changes with the row count unless `linear` fixes it)."""
    k, n = shape
    generator = torch.Generator().manual_seed(k + n)
    weight = native.prepare_weight(torch.randn(n, k, generator=generator).to(dtype))
    x = torch.randn(700, k, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([native.linear(x[i:i + 1], weight) for i in (0, 37, 130, 699)])
        torch.set_num_threads(threads)
        for rows in (2, 33, 64, 100, 128, 129, 300, 700):
            for start in (0, 5, 130 - rows % 131):
                if start + rows > 700:
                    continue
                batch = native.linear(x[start:start + rows], weight)
                for i, row in enumerate((0, 37, 130, 699)):
                    if start <= row < start + rows:
                        assert torch.equal(batch[row - start], alone[i]), (rows, start, row)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_of_no_rows_is_empty(native: CpuKernels, dtype: torch.dtype) -> None:
    """A step of prompt chunks that all end before their prompt does samples nothing: its
    vocabulary projection has no rows (on the AMX path that once raised instead)."""
    weight = native.prepare_weight(torch.randn(300, 64).to(dtype))
    out = native.linear(torch.randn(0, 64).to(dtype), weight)
    assert out.shape == (0, 300) and out.dtype == dtype


def test_a_step_of_prompt_chunks_alone_samples_nothing(smol_f32: LoadedModel) -> None:
    """A prompt longer than a step's token budget runs its first chunks in steps that sample
    nothing, in the model dtype the chip is fast at, and then answers as a run in one go."""
    prompt = list(range(100, 300))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    chunked = LLM(smol_f32, max_num_batched_tokens=64, max_num_seqs=4)
    whole = LLM(smol_f32, dtype=chunked.config.dtype)
    assert chunked.generate([prompt], params)[0].output_token_ids \
        == whole.generate([prompt], params)[0].output_token_ids
