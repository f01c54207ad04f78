"""Errors the engine raises for conditions a caller can act on."""


class EngineError(Exception):
    """Base class of pdserve engine errors."""


class ConfigError(EngineError, ValueError):
    """A configuration value is out of range or of the wrong type."""


class ModelLoadError(EngineError):
    """The model cannot be loaded: missing path, corrupt file, unsupported architecture."""


class RequestRejectedError(EngineError):
    """A request cannot be admitted (too long for the cache or for maxSeqLen)."""


class GrammarError(RequestRejectedError):
    """A constraint that does not compile (its message says why): ``engine.grammars``."""


class KVImportError(EngineError):
    """Received KV blocks do not match this engine (layout, dtype, block size or model)."""
