"""The two kinds of failure the product reports: bad usage (exit 2) and run-time failure (exit 1)."""


class DsparkError(Exception):
    """A failure at run time with a one-line reason (CLI exit code 1)."""

    exit_code = 1


class UsageError(DsparkError, ValueError):
    """Bad input from the caller: a flag, a prompt, a name that names nothing (CLI exit code 2)."""

    exit_code = 2


class ModelLoadError(DsparkError):
    """A model file or folder exists but cannot be loaded (corrupt, unsupported)."""

