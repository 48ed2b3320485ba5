"""What a shard call can refuse with, in a module without torch: the callers that only route calls
(``actors.calls``, ``actors.sequencer``) import it without the shard's dependencies."""
from __future__ import annotations


class NoIndexError(RuntimeError):
    """The shard has not encoded (or reloaded) any version yet."""


class VersionUnavailable(LookupError):
    """The shard holds neither in memory nor on disk the version a call asked for."""
