"""Errors the converters raise for bad input.

Every converter failure that the user can fix (a bad path, a corrupt file, a wrong shape) is a
`ConvertError`: the CLI prints its message as one line and exits 2, with no traceback. Anything
else is a bug and keeps its traceback. They subclass ValueError so callers that only know the
standard library can still catch them.
"""


class ConvertError(ValueError):
    """Base class: a conversion cannot proceed because of its input or its output location."""


class CheckpointError(ConvertError):
    """A checkpoint on disk is unreadable, truncated, or inconsistent (names the file and tensor)."""


class OutputExistsError(ConvertError):
    """The output location already holds a checkpoint (or other files) and overwriting was not asked for."""


class TensorMismatchError(ConvertError):
    """A tensor has a shape or dtype other than the one expected (names the tensor)."""


class FetchError(ConvertError):
    """Downloading or unpacking an external artifact (e.g. the SmolLM2 wheel) failed."""


class UnsupportedModelError(ConvertError):
    """The model architecture or file type is not one this converter handles."""
