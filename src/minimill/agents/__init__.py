"""Durable agents: a tenant's harness (`async def main(ctx, task)` in a Python file) run by
runners under leases, every effect journaled in the store so that a runner's loss costs no
effect twice.

- `runtime.py`: the `ctx` a harness gets (chat, box, map, budget, log, sleep_until) and the
  journal it replays.
- `runner.py`: the runner loop a worker runs (`minimill worker --agents N`); `api_effects.py`
  its HTTP: the runner protocol, and effects through the public API with the lease's key.
- `harness_process.py`: each harness in a sandboxed process of its own, its effects performed
  by the runner; `harness_child.py` is what runs in that process.
- `client.py`: start, follow and cancel agents over `/v1/agents`.
"""
