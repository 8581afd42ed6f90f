"""The experts layer in one C++ call (csrc/moe.cpp) against the PyTorch loop over the active
experts that it replaces, on the same GEMM calls (the same rows per call) and activations: bit
for bit, for Qwen3-MoE's, gpt-oss's and DeepSeek-V3's experts and routing, in float32 and
bfloat16, with AMX's fixed rows per call and with the chunked rule of the other CPUs, on the
AMX tiles' own GEMM (csrc/amx_gemm.cpp) where the CPU has them and on the float32 panels'
(csrc/panel_gemm.cpp) everywhere; and a token's output alone equal to its output in a batch."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from minimill.engine.kernels import CpuKernels, TorchKernels
from minimill.engine.moe import ExpertWeights, GroupedRouting, experts_forward
from minimill.engine.native import load_cpu_kernels

DTYPES = [torch.float32, torch.bfloat16]
STYLES = ["qwen3_moe", "gpt_oss", "deepseek_v3"]
SWIGLU = (1.702, 7.0)


class PythonLoop(CpuKernels):
    """The CPU kernels' GEMMs and activations, driven by the PyTorch loop over experts."""

    experts = TorchKernels.experts


def kernels(cls: type[CpuKernels], amx: bool) -> CpuKernels:
    state = load_cpu_kernels()
    assert state.available, state.reason
    ops = cls()
    # Either rule for the rows of a GEMM call runs on any CPU; each is batch-invariant only
    # where it is chosen, but the two paths make the same calls under both.
    ops._amx_bf16 = amx
    return ops


@dataclass
class Layer:
    weights: ExpertWeights
    top_k: int
    swiglu: tuple[float, float] | None = None
    grouped: GroupedRouting | None = None

    def forward(self, ops: CpuKernels, x: torch.Tensor) -> torch.Tensor:
        return experts_forward(ops, x, self.weights, self.top_k, True, self.swiglu,
                               self.grouped)


def amx_tiles() -> bool:
    return load_cpu_kernels().available and CpuKernels()._amx_tiles


NEEDS_TILES = pytest.mark.skipif(not amx_tiles(), reason="the CPU has no AMX tiles")


def random_layer(style: str, dtype: torch.dtype, ops: CpuKernels,
                 tiles: bool = False) -> tuple[Layer, int]:
    """A small random layer of `style` and its hidden size. gpt-oss's has widths that are not
    a multiple of the vector width (the kernels' scalar tails) and gate values past the clamp.
    `tiles`: widths the AMX tiles and the float32 panels divide, the experts packed by
    `prepare_expert_weights` (bf16 for the tiles where the CPU has them, float32 in panels)."""
    g = torch.Generator().manual_seed(STYLES.index(style))
    if tiles:
        num_experts, hidden, inner = {"qwen3_moe": (8, 64, 32), "gpt_oss": (6, 96, 64),
                                      "deepseek_v3": (16, 64, 64)}[style]
    else:
        num_experts, hidden, inner = {"qwen3_moe": (8, 64, 32), "gpt_oss": (6, 72, 40),
                                      "deepseek_v3": (16, 64, 48)}[style]

    def matrix(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * scale / cols ** 0.5).to(dtype)

    if tiles:
        pairs = [ops.prepare_expert_weights(matrix(2 * inner, hidden, 4.0), matrix(hidden, inner))
                 for _ in range(num_experts)]
        gate_up, down = [p[0] for p in pairs], [p[1] for p in pairs]
    else:
        gate_up = [ops.prepare_weight(matrix(2 * inner, hidden, 4.0))
                   for _ in range(num_experts)]
        down = [ops.prepare_weight(matrix(hidden, inner)) for _ in range(num_experts)]
    if style == "gpt_oss":
        weights = ExpertWeights(
            router=ops.prepare_weight(matrix(num_experts, hidden)), gate_up=gate_up, down=down,
            router_bias=torch.randn(num_experts, generator=g).to(dtype),
            gate_up_bias=[torch.randn(2 * inner, generator=g).to(dtype)
                          for _ in range(num_experts)],
            down_bias=[torch.randn(hidden, generator=g).to(dtype) for _ in range(num_experts)])
        return Layer(weights, 2, swiglu=SWIGLU), hidden
    if style == "deepseek_v3":
        router = ops.prepare_weight(matrix(num_experts, hidden).float())
        weights = ExpertWeights(router=router, gate_up=gate_up,
                                down=down, score_bias=torch.randn(num_experts, generator=g))
        return Layer(weights, 4, grouped=GroupedRouting(4, 2, 2.5)), hidden
    router = ops.prepare_weight(matrix(num_experts, hidden))
    return Layer(ExpertWeights(router=router, gate_up=gate_up, down=down), 2), hidden


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", STYLES)
def test_the_cpp_layer_equals_the_python_loop(style: str, dtype: torch.dtype, amx: bool) -> None:
    native, loop = kernels(CpuKernels, amx), kernels(PythonLoop, amx)
    layer, hidden = random_layer(style, dtype, native)
    g = torch.Generator().manual_seed(7)
    for tokens in (1, 2, 37, 300):
        x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
        got = layer.forward(native, x)
        assert got.shape == x.shape and got.dtype == dtype
        assert torch.equal(got, layer.forward(loop, x)), tokens


@NEEDS_TILES
@pytest.mark.parametrize("style", STYLES)
def test_the_cpp_layer_equals_the_python_loop_on_amx_tiles(style: str) -> None:
    native, loop = kernels(CpuKernels, True), kernels(PythonLoop, True)
    layer, hidden = random_layer(style, torch.bfloat16, native, tiles=True)
    assert all(w.dim() == 4 for w in layer.weights.gate_up + layer.weights.down)
    g = torch.Generator().manual_seed(7)
    for tokens in (1, 2, 37, 300):
        x = (torch.randn(tokens, hidden, generator=g) * 2).to(torch.bfloat16)
        got = layer.forward(native, x)
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        assert torch.equal(got, layer.forward(loop, x)), tokens


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("style", STYLES)
def test_the_cpp_layer_equals_the_python_loop_on_float32_panels(style: str, amx: bool) -> None:
    native, loop = kernels(CpuKernels, amx), kernels(PythonLoop, amx)
    layer, hidden = random_layer(style, torch.float32, native, tiles=True)
    assert all(w.dim() == 3 for w in layer.weights.gate_up + layer.weights.down)
    g = torch.Generator().manual_seed(7)
    for tokens in (1, 2, 37, 300):
        x = torch.randn(tokens, hidden, generator=g) * 2
        got = layer.forward(native, x)
        assert got.shape == x.shape and got.dtype == torch.float32
        assert torch.equal(got, layer.forward(loop, x)), tokens


def test_the_panel_gemm_computes_the_product() -> None:
    """panel_linear against float64's product: within float32's rounding; a row gives the same
    bits alone, among up to 13 others (every block size and split of rows) and on one thread or
    two; the bias is added; a weight the panels do not divide keeps oneDNN's layout."""
    native = kernels(CpuKernels, False)
    width = native._panel_width
    g = torch.Generator().manual_seed(13)
    weight = torch.randn(3 * width, 200, generator=g)
    bias = torch.randn(3 * width, generator=g)
    packed, packed_down = native.prepare_expert_weights(weight, weight[:, :2 * width].t())
    assert packed.dim() == 3 and packed_down.dim() == 3
    x = torch.randn(14, 200, generator=g)
    got = native.expert_linear(x, packed, bias)
    want = (x.double() @ weight.double().t() + bias.double())
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for rows in range(1, 15):
                assert torch.equal(native.expert_linear(x[:rows], packed, bias), got[:rows])
                assert torch.equal(native.expert_linear(x[14 - rows:], packed, bias),
                                   got[14 - rows:])
    finally:
        torch.set_num_threads(threads)
    down_want = got.double() @ weight[:, :2 * width].double()
    down_got = native.expert_linear(got, packed_down).double()
    assert float((down_got - down_want).abs().max()) <= 1e-5 * float(down_want.abs().max())
    assert native.expert_linear(x[:0], packed).shape == (0, 3 * width)
    # A width the panels do not divide keeps oneDNN's layout, both weights alike.
    assert [w.dim() for w in native.prepare_expert_weights(weight[:width + 8], weight.t())] \
        == [2, 2]


@NEEDS_TILES
def test_the_tiles_gemm_computes_the_product() -> None:
    """amx_linear against float32's product of the same bf16 values: within the output's
    rounding; a row alone gives the bits it gives among 36 others; the bias is added."""
    native = kernels(CpuKernels, True)
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(96, 128, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    packed, packed_down = native.prepare_expert_weights(weight, weight.t())
    assert packed.dim() == 4 and packed_down.dim() == 4
    x = torch.randn(37, 128, generator=g).to(torch.bfloat16)
    got = native.expert_linear(x, packed, bias)
    want = x.float() @ weight.float().t() + bias.float()
    assert float((got.float() - want).abs().max()) <= 2 ** -7 * float(want.abs().max())
    for row in (0, 17, 36):
        assert torch.equal(native.expert_linear(x[row:row + 1], packed, bias)[0], got[row])
    down_want = got.float() @ weight.float()
    down_got = native.expert_linear(got, packed_down).float()
    assert float((down_got - down_want).abs().max()) <= 2 ** -7 * float(down_want.abs().max())
    # An expert the tiles do not divide keeps oneDNN's layout, both of its weights alike.
    assert [w.dim() for w in native.prepare_expert_weights(weight, weight[:, :72])] == [2, 2]


@pytest.mark.parametrize(("dtype", "tiles"), [
    (torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
    pytest.param(torch.bfloat16, True, marks=NEEDS_TILES)])
@pytest.mark.parametrize("style", STYLES)
def test_a_tokens_output_does_not_depend_on_its_batch(style: str, dtype: torch.dtype,
                                                      tiles: bool) -> None:
    """One row alone, then inside 37 other rows at two places: the experts it shares with
    others see other row counts and other places in their GEMM calls (packed: float32 in
    panels, bf16 on the AMX tiles)."""
    native = kernels(CpuKernels, CpuKernels()._amx_bf16)
    layer, hidden = random_layer(style, dtype, native, tiles)
    x = torch.randn(38, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    alone = layer.forward(native, x[:1])
    assert torch.equal(layer.forward(native, x)[0], alone[0])
    assert torch.equal(layer.forward(native, x.roll(20, dims=0))[20], alone[0])
    # And not only equal to itself: the batch's other tokens have outputs of their own.
    assert not torch.equal(layer.forward(native, x)[1], alone[0])


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_nobody_chose_one_token_and_no_tokens(dtype: torch.dtype, amx: bool) -> None:
    native, loop = kernels(CpuKernels, amx), kernels(PythonLoop, amx)
    layer, hidden = random_layer("gpt_oss", dtype, native)
    w = layer.weights
    assert w.gate_up_bias is not None and w.down_bias is not None
    g = torch.Generator().manual_seed(5)
    # One token; a token choosing one expert twice; two experts for everyone, past the most
    # rows of one GEMM call in the chunked rule (600: a chunk of 88 after 512; 513: of one).
    for ids in ([[3, 1]], [[2, 2]], [[0, 5], [5, 0], [5, 5]], [[0, 5]] * 600, [[4, 1]] * 513):
        expert_ids = torch.tensor(ids)
        routing = torch.rand(expert_ids.shape, generator=g).to(dtype)
        x = torch.randn(len(ids), hidden, generator=g).to(dtype)
        args = (x, expert_ids, routing, w.gate_up, w.down, w.gate_up_bias, w.down_bias, SWIGLU)
        got = native.experts(*args)
        assert torch.equal(got, loop.experts(*args)), ids
        # Only the chosen experts count: the biases of the others change nothing.
        unused = [e for e in range(len(w.gate_up)) if e not in expert_ids]
        others = [b + 1 if e in unused else b for e, b in enumerate(w.down_bias)]
        assert torch.equal(native.experts(*args[:6], others, SWIGLU), got)
    empty = native.experts(torch.empty(0, hidden, dtype=dtype),
                           torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2, dtype=dtype),
                           w.gate_up, w.down, w.gate_up_bias, w.down_bias, SWIGLU)
    assert empty.shape == (0, hidden) and empty.dtype == dtype


def test_an_expert_id_out_of_range_is_refused() -> None:
    native = kernels(CpuKernels, CpuKernels()._amx_bf16)
    layer, hidden = random_layer("qwen3_moe", torch.float32, native)
    w = layer.weights
    with pytest.raises(RuntimeError, match="expert id 8 out of range for 8 experts"):
        native.experts(torch.randn(1, hidden), torch.tensor([[8, 0]]), torch.ones(1, 2),
                       w.gate_up, w.down)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_swiglu_matches_the_reference(dtype: torch.dtype) -> None:
    native = kernels(CpuKernels, False)
    # Gates and ups well past the limit on both sides; a width with a scalar tail.
    gate_up = (torch.randn(37, 2 * 200, generator=torch.Generator().manual_seed(2)) * 6)
    gate_up = gate_up.to(dtype)
    got = native.clamped_swiglu(gate_up, *SWIGLU)
    want = TorchKernels().clamped_swiglu(gate_up, *SWIGLU)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    scale = max(1.0, float(want.float().abs().max()))
    assert float((got.float() - want.float()).abs().max()) <= tolerance * scale


def test_float32_weights_go_in_panels_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts' float32 weights in panels on every CPU, the dense layers' on AVX2 (where the
    panels were measured faster than oneDNN's GEMM); MINIMILL_PANEL_GEMM=0 keeps oneDNN's."""
    from minimill.engine.hardware import cpu_info

    load_cpu_kernels()
    weight = torch.randn(64, 32)
    on = CpuKernels()
    assert [w.dim() for w in on.prepare_expert_weights(weight, weight.t())] == [3, 3]
    assert on.prepare_weight(weight).dim() == (3 if cpu_info().vector_isa == "avx2" else 2)
    assert on.prepare_weight(weight.to(torch.bfloat16)).dim() == 2
    monkeypatch.setenv("MINIMILL_PANEL_GEMM", "0")
    off = CpuKernels()
    assert [w.dim() for w in off.prepare_expert_weights(weight, weight.t())] == [2, 2]
    assert off.prepare_weight(weight).dim() == 2
