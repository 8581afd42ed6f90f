"""Killing a pipeline stage while its engine steps: shared by the pipeline's tests."""

from __future__ import annotations

import os
import signal
import threading

from minimill.engine.core import EngineCore
from minimill.engine.params import SamplingParams

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def kill_stage_mid_batch(core: EngineCore, prompts: list[list[int]], pid: int
                         ) -> BaseException:
    """Step `prompts` and SIGKILL `pid` once tokens come back (with steps in flight); the
    exception the steps ended with. Fails if the engine keeps waiting for the dead stage."""
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, LONG)
    outcome: list[BaseException] = []
    killed = threading.Event()

    def drive() -> None:
        try:
            while core.has_unfinished:
                if core.step().deltas and not killed.is_set():
                    os.kill(pid, signal.SIGKILL)
                    killed.set()
        except BaseException as exc:
            outcome.append(exc)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    driver.join(120)  # generous: a hang is the failure this guards against
    assert not driver.is_alive(), "the engine kept waiting for a dead stage"
    assert killed.is_set() and len(outcome) == 1, outcome
    return outcome[0]
