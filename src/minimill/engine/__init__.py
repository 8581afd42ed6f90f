"""The builtin engine ("the bus"): paged KV cache, continuous batching, throughput first.

Front ends: `llm.LLM` (offline batches) and `async_engine.AsyncEngine` (streams for servers and
workers), both over `core.EngineCore`, whose step is schedule -> execute -> update:
`scheduler.Scheduler` decides, `model_runner.ModelRunner` turns the decision into tensors and
runs `model.DecoderModel`, `sampler` picks tokens, `output` handles text and stop strings.

Where the time goes (SmolLM2-135M, bf16, 2 CPU cores, 256 requests x ~75 prompt + 128 output
tokens; `minimill bench engine` prints it as `time_breakdown`): on an AMX Xeon the linear
layers take about half of a run, paged attention over the cache in place about a quarter (it
waits on KV blocks scattered over the pool), rotary with the KV write, norms and SiLU·up
about a seventh, and sampling, scheduling and the Python around each step the rest. Steps of
64 rows and more run as one group of sequences per core (core_split.py).
"""

from minimill.engine.memory import use_huge_pages_for_tensors

# Before any large tensor of this process (weights, KV pool): see the function.
use_huge_pages_for_tensors()
