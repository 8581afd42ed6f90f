"""The step loop's side of the stream front ends (async_engine.py's thread, engine_process.py's
child process): apply the callers' commands to the EngineCore and step it, each request's
results gathered for its stream (frontend.py delivers them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minimill.engine.frontend import AddRequest, Outcome
from minimill.engine.params import EngineDied, EngineError, FinishReason, TokenDelta

if TYPE_CHECKING:
    from minimill.engine.core import EngineCore


def apply_command(core: EngineCore, command: AddRequest | str,
                  out: dict[str, list[Outcome]]) -> None:
    """Admit or abort a request in the step loop's thread; results go to `out`."""
    if isinstance(command, str):
        delta = core.abort_request(command)
        if delta is None:
            # Aborted before admission or already done: end the stream if still open.
            delta = TokenDelta(command, [], "", FinishReason.ABORT)
        out[command].append(delta)
        return
    try:
        core.add_request(command.request_id, command.prompt_token_ids, command.params,
                         command.resume_token_ids, command.resume_text)
    except Exception as exc:
        out[command.request_id].append(exc)


def step_into(core: EngineCore, out: dict[str, list[Outcome]]) -> None:
    """One step; its deltas and per-request failures go to `out`."""
    try:
        result = core.step()
    except EngineDied:
        raise  # the engine stops; its requests resume elsewhere, not fail here
    except Exception as exc:  # a fault outside any one request: fail them all
        for request_id in list(core.scheduler.requests):
            core.abort_request(request_id)
            out[request_id].append(EngineError(f"the engine step failed: {exc}"))
        return
    for delta in result.deltas:
        out[delta.request_id].append(delta)
    for request_id, error in result.failures.items():
        out[request_id].append(EngineError(f"request failed: {error}"))
