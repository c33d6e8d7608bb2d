"""Errors raised inside the worker (loading a model, running it), one module for the whole package.

Messages are written for the person starting the worker: they name the offending value and say what
would work instead. Errors that cross the wire to a job's submitter live in `jobs.errors`.
"""

from __future__ import annotations

from collections.abc import Iterable

from mlxq.jobs.errors import MlxqError


class WorkerError(MlxqError):
    """Base class for every error raised by the worker package."""


class UnsupportedArchitecture(WorkerError):
    """A checkpoint whose architecture (or a feature of it, e.g. a RoPE type) this worker cannot run."""

    def __init__(
        self, name: str, supported: Iterable[str], what: str = "architecture", why: str = ""
    ) -> None:
        choices = ", ".join(sorted(supported))
        super().__init__(f"unsupported {what} {name!r}{f' ({why})' if why else ''}; supported: {choices}")
        self.name = name
        self.supported = sorted(supported)


class ModelNotFound(WorkerError):
    """A model name that is neither a local checkpoint folder nor fetchable from the Hugging Face Hub."""


class CheckpointError(WorkerError):
    """A checkpoint folder that cannot be loaded: missing files, missing/unexpected keys, wrong shapes."""


class GGUFImportError(WorkerError, ValueError):
    """The GGUF file cannot be imported; the message names the architecture, tensor or type at fault."""
