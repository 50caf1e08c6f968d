"""Errors the CLI reports as one line and a non-zero exit (anything else is a bug and keeps its traceback)."""


class K2Error(Exception):
    """A user-facing error: bad input, a missing file or package, a mismatched artefact."""


class MissingDependency(K2Error):
    """An optional package (TensorRT, Triton, a GPU) that this command needs is not available."""
