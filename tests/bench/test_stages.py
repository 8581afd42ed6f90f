"""A bench's stages said on stderr (bench/stages.py): plain lines where no spinner or bar can
be drawn (a file, a pipe, a CI log), at the start and end of each stage and every
PROGRESS_EVERY_S while requests run."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from minimill.bench import stages


def plain_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_a_stage_says_when_it_starts_and_how_long_it_took() -> None:
    err, out = plain_console()
    with stages.stage(err, "loading the model ..."):
        assert out.getvalue() == "loading the model ...\n"
    lines = out.getvalue().splitlines()
    assert lines[0] == "loading the model ..."
    assert lines[1].startswith("loading the model ... done in ") and lines[1].endswith("s")
    assert len(lines) == 2


def test_requests_are_counted_every_interval_and_at_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    err, out = plain_console()
    with stages.request_progress(err, "generating", 3, len) as finished:
        finished("ab")
        assert out.getvalue() == ""  # less than PROGRESS_EVERY_S in: nothing said yet
        monkeypatch.setattr(stages, "PROGRESS_EVERY_S", 0.0)
        finished("cde")
    monkeypatch.setattr(stages, "PROGRESS_EVERY_S", 1e9)
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "generating: 2 of 3 requests, 5 tokens", "generating: 2 of 3 requests, 5 tokens"]


def test_a_terminal_gets_a_bar_that_counts_the_same() -> None:
    out = io.StringIO()
    err = Console(file=out, force_terminal=True, width=120)
    with stages.request_progress(err, "generating", 2, len) as finished:
        finished("ab")
        finished("c")
    assert "2/2" in out.getvalue() and "3 tokens" in out.getvalue()
