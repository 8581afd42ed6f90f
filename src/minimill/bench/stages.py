"""What a long bench is doing, said on stderr whatever stdout carries.

A bench runs for minutes to most of an hour (a mixture of experts in float32 beside vLLM on two
cores: forty minutes), and its `--json` report goes to stdout at the end. Its stages say
themselves on stderr meanwhile, so a run redirected to a file or watched in a CI log is not
silence: on a terminal as rich's spinner and bar, elsewhere as plain lines, one when a stage
starts, one when it ends, and the request count every PROGRESS_EVERY_S while requests run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console

Finished = TypeVar("Finished")

# How often a run's progress is said as a line where no bar can be drawn.
PROGRESS_EVERY_S = 30.0


@contextmanager
def stage(err: Console, what: str) -> Iterator[None]:
    """`what` ("loading the model ...") while the block runs: a spinner on a terminal, else a
    line now and one with its seconds when it ends."""
    if err.is_terminal:
        with err.status(what):
            yield
        return
    started = time.monotonic()
    err.print(what, highlight=False, soft_wrap=True)
    yield
    err.print(f"{what} done in {time.monotonic() - started:.1f}s", highlight=False,
              soft_wrap=True)


@contextmanager
def request_progress(err: Console, what: str, total: int, tokens_of: Callable[[Finished], int]
                     ) -> Iterator[Callable[[Finished], None]]:
    """A callback for each finished request of `total` (`tokens_of` says its output tokens):
    a bar on a terminal, else a line every PROGRESS_EVERY_S and one at the end."""
    done = tokens = 0
    if err.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        bar = Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[tokens]} tokens"), console=err)
        task = bar.add_task(what, total=total, tokens=0)

        def advance(out: Finished) -> None:
            nonlocal tokens
            tokens += tokens_of(out)
            bar.update(task, advance=1, tokens=tokens)

        with bar:
            yield advance
        return
    started = last = time.monotonic()

    def say(now: float) -> None:
        err.print(f"{what}: {done} of {total} requests, {tokens:,} tokens "
                  f"({now - started:.0f}s)", highlight=False, soft_wrap=True)

    def count(out: Finished) -> None:
        nonlocal done, tokens, last
        done += 1
        tokens += tokens_of(out)
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            say(now)

    yield count
    say(time.monotonic())
