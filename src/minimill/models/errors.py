"""Errors of resolving and loading models. types.py re-exports them, where most callers import
them from; the chat template (chat_template.py), which types.py's tokenizer uses, imports them
from here."""

from __future__ import annotations


class ModelError(Exception):
    """Base class for model-resolution and model-loading errors (message names the file)."""


class UnknownModelError(ModelError):
    """A model name that is neither a known name, a pulled model, nor a path on disk."""


class ModelNotPulledError(ModelError):
    """A known model name whose files are not in the model cache yet (run `minimill pull`)."""


class ModelFileError(ModelError):
    """A model file that is missing, truncated or corrupt; the message names the file."""
