"""What a failed storage call means, in one sentence that names the fix (a wrong key, a
missing container, an endpoint that refuses), secrets masked."""
from __future__ import annotations

import contextlib
import re
from typing import Iterator

from sparkhvd.common.errors import StorageError
from sparkhvd.common.redaction import redact
from sparkhvd.storage.location import Location, public_url

__side__ = "shared"


def cause_of(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    code = getattr(exc, "error_code", None) or ""
    first = text.split("\n", 1)[0]
    return redact(f"{first} [{code}]" if code and str(code) not in first else first)


def diagnose(loc: Location, exc: BaseException) -> str:
    """A one-line likely cause of a storage failure, naming the URL without secrets."""
    text = f"{exc} {getattr(exc, 'error_code', '')}"
    where = public_url(loc.url)
    if re.search(r"ContainerNotFound|container does not exist", text):
        return (f"container {loc.container!r} does not exist in account {loc.account!r} "
                f"({where}): create it, or fix the container in the URL")
    # a 403 status, never the digits of a port or an address (127.0.0.1:40393 is no 403)
    if re.search(r"AuthorizationFailure|AuthenticationFailed|failed to authenticate|"
                 r"AuthorizationPermissionMismatch|not authorized|(?<![\d.:])403(?!\d)",
                 text, re.I):
        return (f"the credentials were rejected for {where}: check the account key / SAS token "
                "/ identity, and that it may write and delete (e.g. 'Storage Blob Data "
                "Contributor')")
    if re.search(r"Failed to resolve|Name or service not known|nodename nor servname|"
                 r"getaddrinfo|Connection refused|Cannot connect|ServiceRequestError|"
                 r"Max retries|timed out", text, re.I):
        return (f"cannot reach the storage endpoint of account {loc.account!r} ({where}): check "
                "the account name, the endpoint/connection string and the network")
    if isinstance(exc, (PermissionError,)):
        return f"permission denied writing {where}: choose a folder you may write to"
    return f"{where}: {cause_of(exc)}"


@contextlib.contextmanager
def explained(loc: Location, action: str) -> Iterator[None]:
    try:
        yield
    except (StorageError, KeyboardInterrupt, FileNotFoundError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise StorageError(f"Could not {action} {public_url(loc.url)}: {diagnose(loc, exc)}. "
                           f"({cause_of(exc)})") from None
