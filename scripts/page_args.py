"""The one argument of the docs generators: the page to write."""

from __future__ import annotations

import argparse
from pathlib import Path


def output_page(description: str, default: str) -> Path:
    """The page named on the command line, else `default`; `--help` prints the usage."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out", nargs="?", type=Path, default=Path(default),
                        help=f"the page to write (default: {default})")
    out: Path = parser.parse_args().out
    return out
