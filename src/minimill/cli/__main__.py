"""`python -m minimill.cli`: the `minimill` command."""

from minimill.cli.main import app

# Guarded: a process pool's worker (anyio.to_process, which serve's batch jobs use) runs the
# parent's main module again under another name, and must not start the command a second time.
if __name__ == "__main__":
    app()
