"""The exceptions kvlink raises.

Every error from the C engine is a :class:`KVLinkError` carrying the C code
and its name (``KVL_ETIMEDOUT`` ...). Where a builtin fits, the class also
subclasses it, so ``except TimeoutError`` works as expected.
"""

from __future__ import annotations


class KVLinkError(Exception):
    """Base class. ``code`` is the C error code, ``name`` its symbolic name."""

    kvl_name = "KVL_UNKNOWN"
    code: int = 0

    @property
    def name(self) -> str:
        return self.kvl_name


class InvalidArgument(KVLinkError, ValueError):
    kvl_name = "KVL_EINVAL"


class OutOfMemory(KVLinkError, MemoryError):
    kvl_name = "KVL_ENOMEM"


class SystemError_(KVLinkError):
    kvl_name = "KVL_ESYS"


class TimeoutError_(KVLinkError, TimeoutError):
    kvl_name = "KVL_ETIMEDOUT"


class Canceled(KVLinkError):
    kvl_name = "KVL_ECANCELED"


class ConnectError(KVLinkError, ConnectionError):
    kvl_name = "KVL_ECONNECT"


class PeerClosed(KVLinkError, ConnectionError):
    kvl_name = "KVL_EPEERCLOSED"


class AuthError(KVLinkError, PermissionError):
    kvl_name = "KVL_EAUTH"


class VersionMismatch(KVLinkError):
    kvl_name = "KVL_EVERSION"


class ProtocolError(KVLinkError):
    kvl_name = "KVL_EPROTO"


class AccessDenied(KVLinkError, PermissionError):
    kvl_name = "KVL_EACCESS"


class OutOfRange(KVLinkError, ValueError):
    kvl_name = "KVL_ERANGE"


class UnknownRegion(KVLinkError, LookupError):
    kvl_name = "KVL_ENOREGION"


class ChecksumMismatch(KVLinkError):
    kvl_name = "KVL_ECRC"


class Busy(KVLinkError):
    kvl_name = "KVL_EBUSY"


class NotSettled(Busy):
    """A cancelled or timed-out batch may still write into its local memory: the backend could not stop
    its transfers in flight (Mooncake cannot abort submitted ones). Keep the memory alive and cancel
    again; only a cancel that returns means nothing writes there any more."""


class Closed(KVLinkError):
    kvl_name = "KVL_ECLOSED"


class InsecureListener(KVLinkError, ValueError):
    kvl_name = "KVL_EINSECURE"


class TooBig(KVLinkError, ValueError):
    kvl_name = "KVL_ETOOBIG"


class UnknownPeer(KVLinkError, LookupError):
    kvl_name = "KVL_ENOPEER"


class QueueFull(KVLinkError):
    kvl_name = "KVL_EFULL"


class RemoteError(KVLinkError):
    kvl_name = "KVL_EREMOTE"


class SameHostUnavailable(KVLinkError):
    kvl_name = "KVL_ELOCAL"


class PeerChanged(KVLinkError, ConnectionError):
    """A connection to a peer was reopened and another engine answered at its address (a restarted process:
    its region ids and offsets name other memory, so nothing is read from or written to it)."""

    kvl_name = "KVL_EPEERCHANGED"


BY_NAME: dict[str, type[KVLinkError]] = {
    cls.kvl_name: cls for cls in KVLinkError.__subclasses__()  # type: ignore[misc]
}


def error_for(code: int, name: str, message: str) -> KVLinkError:
    """The exception for a C error code (its class chosen by the code's name)."""
    exc = BY_NAME.get(name, KVLinkError)(message)
    exc.code = code
    if type(exc) is KVLinkError:
        exc.kvl_name = name
    return exc
