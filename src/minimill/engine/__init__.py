"""The builtin engine ("the bus"): paged KV cache, continuous batching, throughput first.

Front ends: `llm.LLM` (offline batches) and `async_engine.AsyncEngine` (streams for servers and
workers), both over `core.EngineCore`, whose step is schedule -> execute -> update:
`scheduler.Scheduler` decides, `model_runner.ModelRunner` turns the decision into tensors and
runs `model.DecoderModel`, `sampler` picks tokens, `output` handles text and stop strings.

Where the time goes (SmolLM2-135M, bf16, 2 CPU cores, 256 requests x ~75 prompt + 128 output
tokens, measured with torch.profiler): a decode step of 256 sequences takes ~0.57 s at context
~80 and ~0.76 s at context ~200. Of that, the linear layers (vocabulary projection included)
take ~0.42 s at about the machine's bf16 matmul rate; paged attention takes the rest of the
growth: gathering K/V blocks by block table (DRAM-bound, ~5 ms per layer at context 200) plus
scaled_dot_product_attention over the gathered batch (~3 ms per layer). Norms, rotary, SwiGLU
and sampling together are ~25 ms per step, and the Python around the step (scheduling,
metadata, detokenizing 256 streams) ~3 ms. Prompt chunks (2048 tokens a step) run at ~80% of
the matmul rate; the prefix cache skips the shared prompt blocks.
"""

from minimill.engine.hardware import use_huge_pages_for_tensors

# Before any large tensor of this process (weights, KV pool): see the function.
use_huge_pages_for_tensors()
