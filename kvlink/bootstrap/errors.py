"""Errors of the bootstrap server and client.

One class per failure a caller may want to handle differently. Each class carries the HTTP status and the
stable wire ``code`` the server puts in its JSON error body (``{"error", "code", "field"}``); the client turns
a body back into the same class through :func:`error_from_body`, so both ends raise identical exceptions.

Local misuse (a bad argument) and a misbehaving peer (the server says 400) are both :class:`InvalidField`,
which also is a builtin ``ValueError``; ``field`` names the culprit.
"""

from __future__ import annotations

import builtins


class BootstrapError(Exception):
    """Base class of everything the bootstrap package raises."""

    status: int = 500
    code: str = "internal"
    # Set by the client when an earlier attempt of the call went out and got no answer (then a retry failed):
    # the server may have applied the call, whatever the last attempt says.
    maybe_applied: bool = False

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        if self.field:
            return f"{self.message} (field: {self.field})"
        return self.message


class InvalidField(BootstrapError, builtins.ValueError):
    """A body, argument or configuration value is malformed or out of range (400)."""

    status = 400
    code = "invalid"


class BootstrapConfigError(InvalidField):
    """The server configuration is refused at validation (never sent over the wire)."""

    code = "config"


class UnreadableAnswer(BootstrapError):
    """The server answered 200 with what this client cannot read (a server of another version): it applied
    the call."""

    maybe_applied = True


class Unauthorized(BootstrapError):
    """The bearer token is missing or wrong (401)."""

    status = 401
    code = "unauthorized"


class NotFound(BootstrapError, builtins.LookupError):
    """Unknown route (404)."""

    status = 404
    code = "not_found"


class BootstrapUnavailable(BootstrapError, builtins.ConnectionError):
    """The server cannot serve this now: it is down, restarting, or does not know the engine.

    Raised fast: the client stops retrying once its timeout is spent.
    """

    status = 503
    code = "unavailable"


class UnknownEngine(BootstrapUnavailable, builtins.LookupError):
    """No live registration for this engine (404): never registered, lease ran out, or the server restarted.

    A subclass of :class:`BootstrapUnavailable`: for a decode engine both mean "cannot pair with that engine
    now"; a heartbeating prefill engine answers it by registering again.
    """

    status = 404
    code = "unknown_engine"


class UnknownRequest(BootstrapError, builtins.LookupError):
    """The request id or transfer id was never published, or has been forgotten (404)."""

    status = 404
    code = "unknown_request"


class LookupTimeout(UnknownRequest, builtins.TimeoutError):
    """A long poll ended without the request being published (404, code ``wait_timeout``)."""

    code = "wait_timeout"


class RequestGone(BootstrapError):
    """The request was published but can no longer be pulled (410)."""

    status = 410
    code = "gone"


class RequestExpired(RequestGone):
    """The request's lease ran out; prefill may have freed and reused its blocks (410)."""

    code = "expired"


class RequestReleased(RequestGone):
    """The request was already reported pulled or abandoned; its blocks are freed (410)."""

    code = "released"


class Conflict(BootstrapError):
    """A registration, publish or abandon disagrees with a live one (409)."""

    status = 409
    code = "conflict"


class PayloadTooLarge(InvalidField):
    """The body is larger than the server accepts (413)."""

    status = 413
    code = "too_large"


class MethodNotAllowed(BootstrapError):
    """Wrong HTTP method for the route (405)."""

    status = 405
    code = "method_not_allowed"


class TooManyWaiters(BootstrapError):
    """The server already waits on as many ids as it allows (``max_waiters``); retry later (429)."""

    status = 429
    code = "too_many_waiters"


class TableFull(BootstrapError):
    """The table keeps as many engines (``max_engines``), ranks of this engine (``max_ranks_per_engine``) or
    published requests of this engine (``max_requests_per_engine``) as the server allows: refused, nothing
    stored (429)."""

    status = 429
    code = "table_full"


_BY_CODE: dict[str, type[BootstrapError]] = {
    cls.code: cls
    for cls in (
        BootstrapError,
        InvalidField,
        Unauthorized,
        NotFound,
        BootstrapUnavailable,
        UnknownEngine,
        UnknownRequest,
        LookupTimeout,
        RequestGone,
        RequestExpired,
        RequestReleased,
        Conflict,
        PayloadTooLarge,
        MethodNotAllowed,
        TooManyWaiters,
        TableFull,
    )
}


def error_from_body(status: int, code: str | None, message: str, field: str | None) -> BootstrapError:
    """The exception a client raises for an error answer of the server."""
    cls = _BY_CODE.get(code or "")
    if cls is None:
        if status >= 500:
            cls = BootstrapUnavailable
        elif status == 404:
            cls = NotFound
        elif status in (400, 422):
            cls = InvalidField
        else:
            cls = BootstrapError
    err = cls(message, field=field)
    if cls is BootstrapError:
        err.status = status
    return err
