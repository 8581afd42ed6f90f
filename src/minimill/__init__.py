"""minimill: a token factory serving open-weight language models for background agents."""

__version__ = "0.1.0"
