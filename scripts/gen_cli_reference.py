"""Write the CLI reference page from the `minimill` command's own help.

Walks the typer app behind the `minimill` console script (click's command tree): every group
and command with its usage line, its help text and a table of its arguments and options, as
`--help` prints them. Nothing is copied by hand, so the page cannot drift from the code.

    python scripts/gen_cli_reference.py docs/reference/cli.md
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

import typer
from page_args import output_page

HEADER = """# Command line reference

Generated from the `minimill` command's own help by `scripts/gen_cli_reference.py` (run by
`make docs`): every command, its arguments and options, as `minimill COMMAND --help` prints them.
Options with an environment variable read it when the option is not given.
"""


# typer builds click-style commands (its own copy of click's classes since typer 0.20): they
# are walked by their click interface, duck-typed.
Command = Any


def root_command() -> Command:
    """The click command behind the `minimill` console script (pyproject's [project.scripts])."""
    [script] = [ep for ep in entry_points(group="console_scripts") if ep.name == "minimill"]
    app = script.load()
    return typer.main.get_command(app) if isinstance(app, typer.Typer) else app


def _context(command: Command, name: str, parent: Any = None) -> Any:
    return command.context_class(command, info_name=name, parent=parent, terminal_width=100)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _param_rows(command: Command, ctx: Any) -> list[str]:
    rows = []
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        record = param.get_help_record(ctx)
        if record is None:
            continue
        name, help_text = record
        envvar = param.envvar
        if envvar and "env var" not in help_text:
            names = [envvar] if isinstance(envvar, str) else list(envvar)
            help_text += " (env: " + ", ".join(f"`{n}`" for n in names) + ")"
        rows.append(f"| `{_cell(name)}` | {_cell(help_text)} |")
    return rows


def _command_section(command: Command, ctx: Any, depth: int) -> list[str]:
    path = ctx.command_path
    lines = [f"{'#' * min(depth, 4)} `{path}`", ""]
    if command.help:
        lines += [command.help.strip(), ""]
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines += ["```text", f"{path} {usage}".rstrip(), "```", ""]
    rows = _param_rows(command, ctx)
    if rows:
        lines += ["| argument or option | help |", "|---|---|", *rows, ""]
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            lines += _command_section(sub, _context(sub, name, ctx), depth + 1)
    return lines


def render() -> str:
    root = root_command()
    ctx = _context(root, "minimill")
    return "\n".join([HEADER, *_command_section(root, ctx, 2)]) + "\n"


def main() -> None:
    out = output_page("Write the CLI reference page.", "docs/reference/cli.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())


if __name__ == "__main__":
    main()
