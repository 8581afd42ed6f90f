"""The `minimill` command: arguments and rendering, one module per command group (main.py
assembles them). Only this package prints; what it calls returns values or reports progress
through callbacks.

`minimill.cli:app` (the console script, pyproject's [project.scripts]) is resolved on first use,
so that importing one command group's module does not build the whole command tree."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "app":
        from minimill.cli.main import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
