"""Errors the engine raises for bad input; each carries a one-line, user-facing message."""


class TokenmillError(Exception):
    """Base class: ``str(err)`` is a single line that names the problem, fit for a CLI or a 4xx."""


class ModelLoadError(TokenmillError):
    """A model folder is missing, incomplete, or describes an architecture we do not serve."""


class ModelFetchError(TokenmillError):
    """The default model could not be downloaded, verified or converted."""


class RequestRejected(TokenmillError):
    """A request can never be served by this engine: prompt + max_tokens exceeds the model's
    context or the whole KV pool."""
