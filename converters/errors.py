"""The one error type model loading raises: a message for a person, never a bare traceback."""


class ModelLoadError(ValueError):
    """A model could not be loaded: missing path, unknown architecture, unsupported or corrupt
    weights. The message says which."""
