"""Errors the engine raises for bad input; each carries a one-line, user-facing message."""


class TokenmillError(Exception):
    """Base class: ``str(err)`` is a single line that names the problem, fit for a CLI or a 4xx."""


class ModelLoadError(TokenmillError):
    """A model folder is missing, incomplete, or describes an architecture we do not serve."""


class ModelFetchError(TokenmillError):
    """The default model could not be downloaded, verified or converted."""


class RequestRejected(TokenmillError):
    """A request can never be served by this engine: prompt + max_tokens exceeds the model's
    context or the whole KV pool.

    Args:
        message: the one-line reason.
        blame: what the client must cut, when the refusal knows: ``"prompt"`` (it alone can
            never fit) or ``"max_tokens"`` (the prompt fits, the output budget does not); None
            names the prompt.
    """

    def __init__(self, message: str, *, blame: str | None = None):
        super().__init__(message)
        self.blame = blame
