"""`python -m minimill.cli`: the `minimill` command."""

from minimill.cli.main import app

app()
