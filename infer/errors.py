"""Exception types the engine raises for bad input; each message names the problem and the fix."""


class InferError(Exception):
    """Base class for every error the engine raises on purpose."""


class CheckpointError(InferError, ValueError):
    """A checkpoint directory is missing, incomplete, corrupt or of an unsupported kind."""


class CacheFullError(InferError, ValueError):
    """A write would go past the cache's capacity; nothing already in the cache was changed."""


class ChatTemplateError(InferError, ValueError):
    """A chat template failed to compile or render (including its own `raise_exception`)."""
