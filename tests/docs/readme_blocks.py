"""The README's fenced code blocks, each with the marker comment the line above it may hold.

Markers (an HTML comment on the line before the fence):
- `<!-- not tested: WHY -->`: the block is not run; WHY says why (it needs the internet, it
  starts the server the tests start themselves, it takes minutes of a whole machine).
- `<!-- test: file NAME -->`: the block is a file the other blocks use, written as NAME.
- `<!-- test: background "REGEX" -->`: the block starts a long-running process; it passes
  once its output matches REGEX, and is then stopped.
Every other block runs to completion and must exit 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"(?:^<!-- (?P<marker>.*?) -->\n)?^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```\n",
                    re.S | re.M)
_MARKER = re.compile(r'not tested: (?P<why>\S.*)|test: file (?P<file>[\w.-]+)'
                     r'|test: background "(?P<ready>[^"]+)"')


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    body: str
    not_tested: str | None = None  # why
    file: str | None = None
    ready: str | None = None  # a background block's ready pattern

    @property
    def id(self) -> str:
        return f"line{self.line}-{self.lang}"


def readme_blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    blocks = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("lang")) + 1
        marker = match.group("marker")
        fields: dict[str, str | None] = {}
        if marker is not None:
            parsed = _MARKER.fullmatch(marker)
            if parsed is None:
                raise ValueError(f"README line {line}: unknown marker <!-- {marker} -->")
            fields = {"not_tested": parsed.group("why"), "file": parsed.group("file"),
                      "ready": parsed.group("ready")}
        blocks.append(Block(line, match.group("lang"), match.group("body"), **fields))
    return blocks
