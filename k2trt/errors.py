"""Errors the CLI reports as one line and a non-zero exit (anything else is a bug and keeps its traceback)."""

# The exit status of a command whose stdout reader closed the pipe (`k2trt plan | head`): 128 + SIGPIPE, what a
# shell reports for a command killed by the same event. Not a failure: nothing is printed.
READER_GONE = 141


class K2Error(Exception):
    """A user-facing error: bad input, a missing file or package, a mismatched artefact."""


class MissingDependency(K2Error):
    """An optional package (TensorRT, Triton, a GPU) that this command needs is not available."""
