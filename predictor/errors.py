"""The predictor's one error for a model that cannot be used, raised by the registry when it loads one
and by the control plane when it cannot start its scorer; the message names the file or path."""


class ModelError(ValueError):
    """A model directory that cannot be used; the message names the file and what is wrong."""
