"""The error vocabulary of specdec.

Every failure the engines and the algorithm can report is one of these classes. Servicers map
them to gRPC status codes in exactly one place (each class names its code in ``code``, and
``specdec.runtime.grpc_server.status_of`` reads it), so the algorithm never imports gRPC and a
client always gets a status that names the problem.
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class. ``code`` is the gRPC status name a servicer should answer with."""

    code = "INTERNAL"

    def __reduce__(self):
        # Picklable with the constructor's own arguments, so errors survive a Ray hop intact.
        return (self.__class__, getattr(self, "_init_args", self.args))


class InvalidArgumentError(SpecdecError, ValueError):
    """A request field is out of range or malformed; ``field`` names it."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self._init_args = (field, message)


class MalformedProposalError(InvalidArgumentError):
    """A draft block (tokens + shipped q) that fails validation (docs/exactness.md, "Sparse q")."""


class NonFiniteLogitsError(SpecdecError, ArithmeticError):
    """A model produced NaN or +inf logits; no distribution can be formed from them."""

    code = "INTERNAL"


class ResourceExhaustedError(SpecdecError):
    """Capacity: too many sessions, or a KV-cache byte cap would be exceeded."""

    code = "RESOURCE_EXHAUSTED"


class SessionNotFoundError(SpecdecError, KeyError):
    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "session not found"


class StaleStepError(SpecdecError):
    """A commit/propose/verify whose step number or base length does not follow the session's
    state: stale, duplicated with different content, or out of order. Refused, never applied."""

    code = "FAILED_PRECONDITION"


class SessionExistsError(SpecdecError):
    code = "ALREADY_EXISTS"


class ModelLoadError(SpecdecError):
    code = "NOT_FOUND"


class PeerError(SpecdecError):
    """A draft/target service answered with an error status, or could not be reached; ``code`` is
    the status name to pass on (e.g. UNAVAILABLE for a lost peer)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self._init_args = (code, message)


class LeaseLostError(SpecdecError):
    """Another coordinator took the request over (this one's lease lapsed): this one must stop
    generating it; the client resumes with resume_from_index, from any coordinator."""

    code = "ABORTED"


class UnauthenticatedError(SpecdecError):
    """A call to a public API without a valid API key (where keys are configured)."""

    code = "UNAUTHENTICATED"


class ReaderStalledError(SpecdecError):
    """A streaming client read nothing for the stall timeout: its generation was stopped and its
    sessions freed, rather than kept waiting for it (the HTTP API sends the same as a 408 event)."""

    code = "DEADLINE_EXCEEDED"

    def __init__(self, seconds: float):
        super().__init__(f"the client read nothing for {seconds:.0f} s: the generation was stopped")
        self._init_args = (seconds,)


class ReplicaFaultError(SpecdecError):
    """The replica itself failed while running a work (its batched pass, its admission, its
    bookkeeping), not the request: the work's session is released and the caller may retry on
    any replica (the coordinator fails over, as for a lost replica)."""

    code = "UNAVAILABLE"


class DrainingError(SpecdecError):
    """The replica is shutting down: it finishes its live sessions but takes no new ones."""

    code = "UNAVAILABLE"
