"""The int4 KV cache: quantization error, sealing and staging, the compiled attention against
the reference, and engines with int4 KV against the model-dtype cache."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS

from minimill.engine.attention import (
    allocate_kv_cache,
    attend_gathered,
    build_metadata,
    layer_views,
)
from minimill.engine.config import EngineConfig
from minimill.engine.kernels import CpuKernels, TorchKernels
from minimill.engine.kv_int4 import (
    INT4_GROUP,
    INT4_STAGE_UNIT,
    INT4_UNITS_PER_GROUP,
    dequantize_int4_k,
    dequantize_int4_v,
    int4_step,
    paged_attention_int4_reference,
    quantize_int4,
    stage_layer_views,
    stage_units_per_block,
    stage_view,
    write_kv_int4_reference,
)
from minimill.engine.llm import LLM
from minimill.engine.native import load_cpu_kernels
from minimill.engine.params import InvalidRequestError, SamplingParams
from minimill.models.types import LoadedModel

CPU = torch.device("cpu")
G = INT4_GROUP


def test_int4_quantization_error_is_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, 3, 64, generator=g) * torch.rand(200, 3, 1, generator=g) * 10
    x[0, 0] = 1.5  # a constant vector keeps a usable scale and comes back exactly
    for dim in (-1, -2):
        codes, scales, lows = quantize_int4(x, dim)
        assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
        assert scales.dtype == lows.dtype == torch.float16
        restored = lows.float().unsqueeze(dim) + scales.float().unsqueeze(dim) * codes.float()
        step = scales.float().unsqueeze(dim)
        # Half a step, plus the float16 rounding of the minimum.
        bound = step / 2 + lows.float().abs().unsqueeze(dim) * 2**-11 + 1e-6
        assert ((restored - x).abs() <= bound).all()
        # 15 steps span the range (up to float16 rounding of the step and the minimum).
        span = x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)
        slack = lows.float().abs().unsqueeze(dim) * 2**-10
        assert ((step * 15 <= span * (1 + 2**-9) + slack) | (span == 0)).all()
    codes, scales, lows = quantize_int4(x, -1)
    assert torch.equal(lows[0, 0].float() + scales[0, 0].float() * codes[0, 0].float(),
                       torch.full((64,), 1.5))


class Int4Cache:
    """One layer of an int4 pool whose blocks also stage open blocks, fed sequences step by
    step; keeps the exact K/V written so far to compare with."""

    def __init__(self, tables: list[list[int]], units: list[list[int]], kv_heads: int,
                 head_dim: int, seed: int, native: CpuKernels | None = None) -> None:
        self.native = native
        per_block = stage_units_per_block(head_dim)
        num_blocks = max(max(b for t in tables for b in t),
                         max(u // per_block for us in units for u in us)) + 1
        self.pool = allocate_kv_cache(num_blocks, 1, kv_heads, G, head_dim, torch.uint8, CPU)
        # Staging units share the pool's bytes; whatever those blocks held is overwritten.
        self.pool.fill_(0xFF)
        self.stage = stage_view(self.pool, head_dim)
        self.tables, self.units = tables, units
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.g = torch.Generator().manual_seed(seed)
        self.k: list[torch.Tensor] = [torch.empty(0, kv_heads, head_dim) for _ in tables]
        self.v: list[torch.Tensor] = [torch.empty(0, kv_heads, head_dim) for _ in tables]
        # Keys get per-channel offsets, as real keys have, which is what per-channel ranges
        # are for.
        self.offsets = torch.randn(kv_heads, head_dim, generator=self.g) * 4

    def step(self, query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, object]:
        """Write this many new tokens per sequence; returns (new k, new v, metadata)."""
        seq_lens = [len(k) + q for k, q in zip(self.k, query_lens, strict=True)]
        tables = [t[:n // G] for t, n in zip(self.tables, seq_lens, strict=True)]  # full
        int4 = int4_step(query_lens, seq_lens, tables, G, self.units, self.stage, CPU)
        meta = build_metadata(query_lens, seq_lens, tables, G, CPU, int4)
        shape = (sum(query_lens), self.kv_heads, self.head_dim)
        k = torch.randn(shape, generator=self.g) + self.offsets
        v = torch.randn(shape, generator=self.g)
        k_cache, v_cache = layer_views(self.pool, 0)
        k_stage, v_stage = stage_layer_views(self.stage, 0)
        if self.native is None:
            write_kv_int4_reference(k_cache, v_cache, k_stage, v_stage, k, v, meta)
        else:
            step = meta.int4
            assert step is not None
            self.native._ops.kv_int4_write(
                k, v, k_cache, v_cache, k_stage, v_stage, step.stage_tokens,
                step.stage_mapping, step.seal_blocks, step.seal_stage, step.seal_tokens,
                step.seal_rows, step.seal_offsets, G)
        start = 0
        for i, q in enumerate(query_lens):
            self.k[i] = torch.cat((self.k[i], k[start:start + q]))
            self.v[i] = torch.cat((self.v[i], v[start:start + q]))
            start += q
        return k, v, meta


# Prompt chunks that end inside a block, exactly at its end, and span several blocks; decodes
# that seal a block and that open one.
STEPS = [[50, 64, 1, 130], [30, 1, 63, 1], [1, 1, 1, 1], [100, 62, 1, 17]]
TABLES = [[5, 2, 7, 11], [1, 3], [9, 4], [0, 6, 8, 10, 12]]


def shared_units(num_seqs: int, first_block: int, head_dim: int) -> list[list[int]]:
    """A whole open block's staging units for each sequence, handed out in turn from pool
    blocks first_block on, so every staging block holds several sequences' units."""
    per_block = stage_units_per_block(head_dim)
    ids = range(first_block * per_block, (first_block + 8) * per_block + INT4_UNITS_PER_GROUP
                * num_seqs)
    return [list(ids[i::num_seqs][:INT4_UNITS_PER_GROUP]) for i in range(num_seqs)]


UNITS = shared_units(4, 13, 64)


def test_sealed_blocks_hold_each_group_within_its_ranges() -> None:
    cache = Int4Cache(TABLES, UNITS, kv_heads=3, head_dim=64, seed=1)
    for query_lens in STEPS:
        cache.step(query_lens)
    k_cache, v_cache = layer_views(cache.pool, 0)
    checked = 0
    for table, k, v in zip(cache.tables, cache.k, cache.v, strict=True):
        for b in range(len(k) // G):
            for blocks, exact, dequantize, dim in (
                    (k_cache, k, dequantize_int4_k, 1), (v_cache, v, dequantize_int4_v, -1)):
                x = exact[b * G:(b + 1) * G].transpose(0, 1)  # [heads, G, d]
                got = dequantize(blocks[table[b]], G, 64)
                step = (x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / 15
                # Tokens staged before the block filled went through int8 first: half an
                # int8 step of the token's range (with 0) more, and float16 rounding.
                token_range = x.clamp(min=0).amax(-1, keepdim=True) \
                    - x.clamp(max=0).amin(-1, keepdim=True)
                bound = step / 2 + token_range / 510 * 1.2 + x.abs() * 2**-10 + 1e-4
                assert ((got - x).abs() <= bound).all()
                assert (got - x).abs().mean() < step.mean() / 3.5
            checked += 1
    assert checked == sum(len(k) // G for k in cache.k) >= 6


def _exact_attention(cache: Int4Cache, q: torch.Tensor, meta: object) -> torch.Tensor:
    width = meta.block_tables.shape[1]  # type: ignore[attr-defined]
    keys = torch.zeros(len(cache.k), cache.kv_heads, width * G, cache.head_dim)
    values = torch.zeros_like(keys)
    for i, (k, v) in enumerate(zip(cache.k, cache.v, strict=True)):
        keys[i, :, :len(k)] = k.transpose(0, 1)
        values[i, :, :len(v)] = v.transpose(0, 1)
    return attend_gathered(q, keys, values, meta, 0.125)  # type: ignore[arg-type]


def test_reference_attention_reads_sealed_and_staged_tokens() -> None:
    """Attention over the int4 cache stays near attention over the exact K/V; the step's own
    tokens are read exactly, and the newest tokens before them (staged in int8) at int8
    accuracy."""
    cache = Int4Cache(TABLES, UNITS, kv_heads=3, head_dim=64, seed=2)
    g = torch.Generator().manual_seed(7)
    for query_lens in STEPS:
        k_new, v_new, meta = cache.step(query_lens)
        q = torch.randn(sum(query_lens), 9, 64, generator=g)
        k_cache, v_cache = layer_views(cache.pool, 0)
        k_stage, v_stage = stage_layer_views(cache.stage, 0)
        got = paged_attention_int4_reference(q, k_new, v_new, k_cache, v_cache, k_stage,
                                             v_stage, meta, 0.125)  # type: ignore[arg-type]
        want = _exact_attention(cache, q, meta)
        assert (got - want).abs().max() < 0.4
        assert (got - want).abs().mean() < 0.03
    # Prompts in their first step: every token they read is their own, so exact (the two
    # fill a block and leave one open), however the cache holds them.
    cache = Int4Cache([[0, 1], [2]], shared_units(2, 3, 64), kv_heads=3, head_dim=64, seed=3)
    k_new, v_new, meta = cache.step([70, 62])
    q = torch.randn(132, 9, 64, generator=g)
    k_cache, v_cache = layer_views(cache.pool, 0)
    k_stage, v_stage = stage_layer_views(cache.stage, 0)
    got = paged_attention_int4_reference(q, k_new, v_new, k_cache, v_cache, k_stage, v_stage,
                                         meta, 0.125)  # type: ignore[arg-type]
    torch.testing.assert_close(got, _exact_attention(cache, q, meta), atol=1e-5, rtol=1e-5)
    # Then one decoding token each: the 6 and 62 tokens before it in open blocks are read
    # from int8 staging (int8-accurate), the first block from its sealed int4.
    k_new, v_new, meta = cache.step([1, 1])
    q = torch.randn(2, 9, 64, generator=g)
    got = paged_attention_int4_reference(q, k_new, v_new, k_cache, v_cache, k_stage, v_stage,
                                         meta, 0.125)  # type: ignore[arg-type]
    error = (got - _exact_attention(cache, q, meta)).abs()
    assert 0 < error[1].max() < 0.1 and error[1].mean() < 0.008
    assert 0 < error[0].max() < 0.4


@pytest.fixture(scope="module")
def native() -> CpuKernels:
    state = load_cpu_kernels()
    if not state.available:
        pytest.skip(f"compiled kernels unavailable: {state.reason}")
    return CpuKernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_native_int4_attention_matches_the_reference(native: CpuKernels, dtype: torch.dtype,
                                                     heads: int, kv_heads: int,
                                                     head_dim: int) -> None:
    cache = Int4Cache(TABLES, shared_units(4, 13, head_dim), kv_heads=kv_heads,
                      head_dim=head_dim, seed=4)
    g = torch.Generator().manual_seed(8)
    for query_lens in STEPS:  # decodes, prompt chunks and block seals in mixed steps
        k_new, v_new, meta = cache.step(query_lens)
        q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
        k_cache, v_cache = layer_views(cache.pool, 0)
        k_stage, v_stage = stage_layer_views(cache.stage, 0)
        scale = head_dim ** -0.5
        want = paged_attention_int4_reference(q, k_new, v_new, k_cache, v_cache, k_stage,
                                              v_stage, meta, scale)  # type: ignore[arg-type]
        got = native.paged_attention_int4(q, k_new, v_new, k_cache, v_cache, k_stage,
                                          v_stage, meta, scale)  # type: ignore[arg-type]
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_native_int4_write_matches_the_reference(native: CpuKernels) -> None:
    """Sealing and staging in C++ store what the reference stores: the same ranges, and
    codes at most one step apart (a value on a rounding boundary may go either way)."""
    ref = Int4Cache(TABLES, UNITS, kv_heads=3, head_dim=64, seed=6)
    nat = Int4Cache(TABLES, UNITS, kv_heads=3, head_dim=64, seed=6, native=native)
    sealed = sorted({b for t in TABLES for b in t})
    per_block = stage_units_per_block(64)
    staging = sorted({u // per_block for us in UNITS for u in us})
    assert len(staging) < sum(len(us) for us in UNITS)  # blocks shared by several units
    unit = INT4_STAGE_UNIT
    for query_lens in STEPS:
        ref.step(query_lens)
        nat.step(query_lens)
        a, b = ref.pool[sealed], nat.pool[sealed]
        nbytes = G * 64 // 2
        codes_a = torch.stack((a[..., :nbytes] & 15, a[..., :nbytes] >> 4)).int()
        codes_b = torch.stack((b[..., :nbytes] & 15, b[..., :nbytes] >> 4)).int()
        assert (codes_a - codes_b).abs().max() <= 1
        assert (codes_a != codes_b).float().mean() < 1e-3
        assert torch.equal(a[..., nbytes:], b[..., nbytes:])
        a, b = ref.stage[staging], nat.stage[staging]
        assert (a.float() - b.float()).abs()[..., :unit * 64].max() <= 1
        assert torch.equal(a[..., unit * 64:], b[..., unit * 64:])


def test_int4_config_sizes_blocks_and_staging_from_one_budget(smol_f32: LoadedModel) -> None:
    mc = smol_f32.config
    budget = 48 << 20
    bf16 = EngineConfig(dtype="bfloat16", kv_cache_memory_bytes=budget, model_config=mc)
    int4 = EngineConfig(dtype="bfloat16", kv_dtype="int4", kv_cache_memory_bytes=budget,
                        model_config=mc)
    assert int4.block_size == G and int4.kv_torch_dtype == torch.uint8
    # 30 layers x 2 x 3 heads x (64 x 64 / 2 + 4 x 64) bytes per 64 tokens: 6480 B/token,
    # ranges included, against bf16's 23040.
    assert int4.kv_bytes_per_token(mc) == 6480
    assert bf16.kv_bytes_per_token(mc) / int4.kv_bytes_per_token(mc) >= 3.5
    # Staging units are pool blocks: the whole budget is blocks.
    assert int4.num_kv_blocks == budget // int4.kv_block_bytes(mc)
    assert 0 < int4.kv_stage_unit_bytes(mc) <= int4.kv_block_bytes(mc)
    assert bf16.kv_stage_unit_bytes(mc) == 0
    # Eight 4-token staging units per pool block (64-dim heads), so a whole open block's
    # sixteen take two blocks: one sequence alone fits in its full blocks and those two.
    assert int4.stage_units_per_block == 8 and bf16.stage_units_per_block == 0
    assert int4.max_model_len == (int4.num_kv_blocks - 2) * G  # type: ignore[operator]
    small = EngineConfig(dtype="float32", kv_dtype="int4", num_kv_blocks=4, model_config=mc)
    assert small.max_model_len == 2 * G
    with pytest.raises(InvalidRequestError, match="at least 3"):
        EngineConfig(dtype="float32", kv_dtype="int4", num_kv_blocks=2, model_config=mc)
    with pytest.raises(InvalidRequestError, match="int4"):
        EngineConfig(dtype="bfloat16", kv_dtype="int3", model_config=mc)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_int4_kv_engine_greedy_mostly_agrees_with_the_model_dtype(
        smol_f32: LoadedModel, kernels: str) -> None:
    """Prompts past one block (sealed groups), decoding into staged tokens: greedy tokens
    with int4 KV agree with a float32 cache for most of their length."""
    tok = smol_f32.tokenizer
    prompts = [tok.encode(p * 4, add_special_tokens=True)[:90] for p in PROMPTS[:3]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = LLM(smol_f32, dtype="float32", num_kv_blocks=64, max_model_len=512)
    want = [o.output_token_ids for o in base.generate(prompts, params)]
    llm = LLM(smol_f32, dtype="float32", kv_dtype="int4", kernels=kernels, num_kv_blocks=16,
              max_model_len=512)
    assert llm.engine.runner.kv_cache.dtype == torch.uint8
    got = [o.output_token_ids for o in llm.generate(prompts, params)]
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
              for x, y in zip(got, want, strict=True)]
    assert sum(prefix) / (len(prompts) * params.max_tokens) >= 0.6, prefix


def test_int4_prefix_reuse_shares_sealed_blocks(smol_f32: LoadedModel) -> None:
    """A repeated prompt reuses the first request's sealed blocks and continues alike."""
    tok = smol_f32.tokenizer
    prompt = tok.encode(PROMPTS[3] * 8, add_special_tokens=True)[:150]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(smol_f32, dtype="float32", kv_dtype="int4", num_kv_blocks=16, max_model_len=512)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.num_cached_tokens == 2 * G  # both full blocks of the prompt
    assert second.output_token_ids == first.output_token_ids


def _text_ids(model: LoadedModel, n: int, shift: int = 0) -> list[int]:
    tok = model.tokenizer
    text = " ".join(PROMPTS[(i + shift) % len(PROMPTS)] for i in range(12))
    ids = tok.encode(text, add_special_tokens=True)
    assert len(ids) >= n
    return ids[:n]


def test_int4_running_sequences_hold_full_blocks_and_staging_units(
        smol_f32: LoadedModel) -> None:
    """Every step, each running int4 sequence holds a block per full block and one staging
    unit per started INT4_STAGE_UNIT (4) tokens of its open block, nothing else, and staging
    blocks are shared: 9 blocks run four 100-token prompts at once (1 full block + 9 to 10
    units each: 4 blocks, and 36 to 40 of the 5 staging blocks' 40 slices) and no fifth,
    without preempting."""
    llm = LLM(smol_f32, dtype="float32", kv_dtype="int4", num_kv_blocks=9, max_model_len=512)
    core = llm.engine
    scheduler, bm = core.scheduler, core.scheduler.block_manager
    per_block = bm.stage_units_per_block
    assert (INT4_STAGE_UNIT, per_block) == (4, 8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(5):
        core.add_request(f"r{i}", _text_ids(smol_f32, 100, shift=i), params)
    seen = 0
    while scheduler.has_unfinished:
        core.step()
        full: set[int] = set()
        units: list[int] = []
        for seq in scheduler.running:
            n = seq.num_computed_tokens
            assert len(seq.block_table) == n // G
            assert len(seq.stage_units) == -(-(n % G) // INT4_STAGE_UNIT)
            full.update(seq.block_table)
            units.extend(seq.stage_units)
        staging = {u // per_block for u in units}
        assert len(set(units)) == len(units) and not staging & full
        assert len(staging) == bm.num_staging_blocks == -(-len(units) // per_block)
        assert len(full) + len(staging) + bm.num_free_blocks == bm.num_blocks
        assert len(scheduler.running) <= 4
        seen += 1
    assert scheduler.max_num_running == 4 and scheduler.num_preemptions == 0
    assert bm.num_free_blocks == bm.num_blocks and seen > 4


def test_int4_sequence_preempted_with_an_open_block_resumes_identically(
        smol_f32: LoadedModel) -> None:
    """Two 70-token prompts in 4 blocks: when their staging units outgrow the two blocks left
    after their sealed ones, the newer one is preempted with an open block, then recomputed
    from its cached sealed block; its greedy tokens are those of an uninterrupted run."""
    prompts = [_text_ids(smol_f32, 70), _text_ids(smol_f32, 70, shift=5)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = LLM(smol_f32, dtype="float32", kv_dtype="int4", num_kv_blocks=16,
                max_model_len=256)
    want = [o.output_token_ids for o in roomy.generate(prompts, params)]
    assert roomy.engine.scheduler.num_preemptions == 0
    tight = LLM(smol_f32, dtype="float32", kv_dtype="int4", num_kv_blocks=4,
                max_model_len=256)
    got = [o.output_token_ids for o in tight.generate(prompts, params)]
    scheduler = tight.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.num_cached_tokens_total >= G
    assert got == want
    assert scheduler.block_manager.num_free_blocks == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_native_rotary_split_gives_the_reference_bits(native: CpuKernels, dtype: torch.dtype,
                                                      heads: int, kv_heads: int,
                                                      head_dim: int) -> None:
    """The int4 path's rotary in C++ (q rotated in the model dtype, K rotated and V in
    float32, for the int4 quantizers) gives exactly the PyTorch path's bits: a code on a
    rounding boundary then goes the same way in both."""
    g = torch.Generator().manual_seed(11)
    tokens = 37
    width = (heads + 2 * kv_heads) * head_dim
    # Rows wider than q, k and v (as a qkv projection with a bias column block would give).
    qkv = torch.randn(tokens, width + 16, generator=g).to(dtype)[:, :width]
    positions = torch.randint(0, 300, (tokens,), generator=g)
    angles = torch.rand(512, head_dim // 2, generator=g) * 40
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1).contiguous()
    want = TorchKernels._rotate(qkv, positions, cos_sin, heads, kv_heads)
    q = qkv.new_empty(tokens, heads, head_dim)
    k = torch.empty(tokens, kv_heads, head_dim)
    v = torch.empty(tokens, kv_heads, head_dim)
    torch.ops.minimill.rotary_split(qkv, positions, cos_sin, q, k, v, heads, kv_heads)
    assert torch.equal(q, want[0]) and q.dtype == dtype
    assert torch.equal(k, want[1])
    assert torch.equal(v, want[2].float())
