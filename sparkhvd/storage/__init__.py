"""One small API over fsspec for local paths, ``file://``, ``abfss://`` and ``az://``.

- Credentials: ``storage_options`` first, then ``AZURE_STORAGE_CONNECTION_STRING``, then
  ``AZURE_STORAGE_ACCOUNT_NAME`` + ``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_SAS_TOKEN``, then
  adlfs' default credential chain (managed identity, Azure CLI, ...).
- Writes are atomic: a reader sees the old object or the whole new one (locally a temp file +
  rename; on Azure one committed upload, or a temporary blob for streamed writes).
- :func:`preflight` writes and deletes a small object so that a bad account, key, container or
  permission fails in seconds, before training.
- :func:`write_or_spill` keeps the bytes in a local spill folder when an upload fails.
- Retries are bounded (:data:`RETRIES`): a refused or unreachable endpoint is reported within
  seconds, throttling and server errors (429/5xx) are retried. Set per call in
  ``storage_options``: ``retry_total``, ``retry_connect``, ``retry_backoff_s``.
- Secrets never appear in messages: see :func:`sparkhvd.common.redaction.redact`.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import re
import uuid
from dataclasses import dataclass
from typing import IO, Any, Iterator, Mapping, Optional
from urllib.parse import urlparse

import fsspec

from sparkhvd.common.errors import StorageError
from sparkhvd.common.redaction import redact, remember_secret

__side__ = "shared"

log = logging.getLogger(__name__)

AZURE_SCHEMES = ("abfss", "abfs", "az")
PREFLIGHT_TIMEOUT_S = 60.0

#: The default retry budget of every Azure operation (``storage_options`` keys override it):
#: ``retry_total`` attempts in all, of which ``retry_connect`` for a refused/unreachable
#: endpoint, waiting ``retry_backoff_s`` (growing) between them.
RETRIES = {"retry_total": 4, "retry_connect": 1, "retry_backoff_s": 1.0}
#: storage_options keys that are sparkhvd's own (never passed to adlfs).
_OWN_KEYS = frozenset(RETRIES) | {"delegate_expiry_s"}

__all__ = ["StorageError", "redact", "remember_secret", "resolve", "read_bytes", "write_bytes",
           "open_atomic", "exists", "listdir", "delete", "preflight", "write_or_spill",
           "public_url", "Location", "RETRIES"]

def public_url(url: str) -> str:
    """A URL safe to print and record: no query string (SAS tokens), no user info."""
    parsed = urlparse(url)
    if not parsed.scheme or len(parsed.scheme) == 1:  # plain path (or a Windows drive)
        return url
    netloc = parsed.netloc.rsplit("@", 1)
    host = netloc[-1]
    user = netloc[0].split(":", 1)[0] if len(netloc) == 2 else None
    if parsed.scheme in AZURE_SCHEMES and user is not None:  # container@account is not a secret
        host = f"{user}@{host}"
    return f"{parsed.scheme}://{host}{parsed.path}"


@dataclass
class Location:
    """A resolved URL: the filesystem to use and the path inside it."""

    url: str
    fs: Any
    path: str
    account: Optional[str] = None
    container: Optional[str] = None

    @property
    def is_local(self) -> bool:
        """Whether this location is on the local disk."""
        return self.account is None and self.container is None

    def child(self, name: str) -> "Location":
        """The location of ``name`` below this one."""
        return Location(self.url.rstrip("/") + "/" + name, self.fs,
                        self.path.rstrip("/") + "/" + name, self.account, self.container)

    def __repr__(self) -> str:
        return f"Location({public_url(self.url)!r})"


def _azure_options(account: Optional[str], storage_options: Mapping[str, Any],
                   environ: Mapping[str, str]) -> dict[str, Any]:
    opts = {k: v for k, v in storage_options.items() if k not in _OWN_KEYS}
    if not any(k in opts for k in ("connection_string", "account_key", "sas_token", "credential",
                                   "anon", "client_secret")):
        if environ.get("AZURE_STORAGE_CONNECTION_STRING"):
            opts["connection_string"] = environ["AZURE_STORAGE_CONNECTION_STRING"]
        elif environ.get("AZURE_STORAGE_ACCOUNT_KEY"):
            opts["account_key"] = environ["AZURE_STORAGE_ACCOUNT_KEY"]
        elif environ.get("AZURE_STORAGE_SAS_TOKEN"):
            opts["sas_token"] = environ["AZURE_STORAGE_SAS_TOKEN"]
        else:
            opts.setdefault("anon", False)  # adlfs' DefaultAzureCredential chain
    if "connection_string" not in opts:
        name = opts.get("account_name") or account or environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        if not name:
            raise ValueError("No Azure storage account given: use "
                             "abfss://container@ACCOUNT.dfs.core.windows.net/path, "
                             "storage_options={'account_name': ...} or AZURE_STORAGE_ACCOUNT_NAME.")
        opts["account_name"] = name
    for key in ("connection_string", "account_key", "sas_token", "client_secret"):
        remember_secret(opts.get(key) if isinstance(opts.get(key), str) else None)
        if key == "connection_string" and opts.get(key):
            for part in opts[key].split(";"):
                if part.lower().startswith(("accountkey=", "sharedaccesssignature=")):
                    remember_secret(part.split("=", 1)[1])
    return opts


def resolve(url: str, storage_options: Optional[Mapping[str, Any]] = None,
            environ: Optional[Mapping[str, str]] = None) -> Location:
    """Turn a path or URL into a :class:`Location` with credentials resolved (see module doc)."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"A storage URL or path is required; got {url!r}.")
    environ = os.environ if environ is None else environ
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file") or len(scheme) == 1:
        path = os.path.abspath(os.path.expanduser(parsed.path if scheme == "file" else url))
        return Location(url, fsspec.filesystem("file"), path)
    if scheme not in AZURE_SCHEMES:
        raise ValueError(f"Unsupported storage URL scheme {scheme!r} in {public_url(url)!r}: use a "
                         "local path, file://, abfss://container@account.dfs.core.windows.net/"
                         "path or az://container/path.")
    if "@" in parsed.netloc:
        container, host = parsed.netloc.split("@", 1)
        account = host.split(".", 1)[0]
    else:
        container, account = parsed.netloc, None
    if not container:
        raise ValueError(f"No container in {public_url(url)!r}: use "
                         "abfss://CONTAINER@account.dfs.core.windows.net/path.")
    opts = _azure_options(account, storage_options or {}, environ)
    fs = fsspec.filesystem("abfs", skip_instance_cache=True, **opts)
    retries = {**RETRIES, **{k: v for k, v in (storage_options or {}).items() if k in RETRIES}}
    from sparkhvd.common.patches import set_storage_retries

    set_storage_retries(fs, total=int(retries["retry_total"]),
                        connect=int(retries["retry_connect"]),
                        backoff_s=float(retries["retry_backoff_s"]))
    path = f"{container}/{parsed.path.lstrip('/')}".rstrip("/")
    return Location(url, fs, path, account=opts.get("account_name") or account,
                    container=container)


def _loc(target: "Location | str", storage_options: Optional[Mapping[str, Any]]) -> Location:
    return target if isinstance(target, Location) else resolve(target, storage_options)


def read_bytes(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None) -> bytes:
    """The whole content of a file or blob."""
    loc = _loc(target, storage_options)
    with _explained(loc, "read"):
        if loc.is_local:
            return loc.fs.cat_file(loc.path)
        return loc.fs.cat_file(loc.path, max_concurrency=TRANSFER_CONCURRENCY)


def exists(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None) -> bool:
    """Whether a file, blob or folder exists."""
    loc = _loc(target, storage_options)
    with _explained(loc, "check"):
        return bool(loc.fs.exists(loc.path))


def listdir(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None) -> list[str]:
    """Names (not paths) of the entries directly below a folder."""
    loc = _loc(target, storage_options)
    with _explained(loc, "list"):
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in loc.fs.ls(loc.path, detail=False))


def delete(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None, *,
           recursive: bool = False) -> None:
    """Remove a file/blob (or a whole folder with ``recursive=True``); missing is not an error."""
    loc = _loc(target, storage_options)
    with _explained(loc, "delete"):
        if loc.fs.exists(loc.path):
            loc.fs.rm(loc.path, recursive=recursive)


def _tmp_sibling(loc: Location) -> Location:
    folder, _, name = loc.path.rpartition("/")
    tmp_name = f".tmp-{uuid.uuid4().hex[:12]}-{name}"
    return Location(loc.url, loc.fs, f"{folder}/{tmp_name}" if folder else tmp_name,
                    loc.account, loc.container)


@contextlib.contextmanager
def open_atomic(target: "Location | str",
                storage_options: Optional[Mapping[str, Any]] = None) -> Iterator[IO[bytes]]:
    """A binary file to write; it replaces ``target`` only if the block finishes without error.

    Locally: :func:`sparkhvd.common.fileio.atomic_open` (temp file, fsync, rename). On Azure: a temp
    blob, its size verified, then moved into place. On error (or interrupt) the temp object is
    removed and the old content of ``target`` is untouched. Exceptions raised by the block
    propagate unchanged.
    """
    loc = _loc(target, storage_options)
    if loc.is_local:
        from sparkhvd.common.fileio import atomic_open

        with atomic_open(loc.path) as f:
            yield f
        return
    tmp = _tmp_sibling(loc)
    with _explained(loc, "write"):
        f = loc.fs.open(tmp.path, "wb")
    writer = _CountingWriter(f, loc)
    try:
        yield writer  # type: ignore[misc]
        with _explained(loc, "write"):
            f.close()
            size = loc.fs.size(tmp.path)
            if size != writer.count:
                raise OSError(f"size check failed after upload ({size} != {writer.count} bytes)")
            loc.fs.mv(tmp.path, loc.path)
    except BaseException:
        with contextlib.suppress(Exception):
            if not f.closed:
                f.close()
        with contextlib.suppress(Exception):
            if loc.fs.exists(tmp.path):
                loc.fs.rm(tmp.path)
        raise


class _CountingWriter:
    def __init__(self, f: IO[bytes], loc: Location) -> None:
        self._f = f
        self._loc = loc
        self.count = 0

    def write(self, data: bytes) -> int:
        with _explained(self._loc, "write"):
            self._f.write(data)
        self.count += len(data)
        return len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


#: Parallel block transfers for one blob (the Azure SDK's ``max_concurrency``).
TRANSFER_CONCURRENCY = 4


def write_bytes(target: "Location | str", data: bytes,
                storage_options: Optional[Mapping[str, Any]] = None) -> None:
    """Write ``data`` atomically.

    Locally through :func:`open_atomic`. On Azure in one upload straight to the final blob:
    the service commits a Put Blob / Put Block List atomically (readers see the old blob or the
    whole new one; a broken upload commits nothing), so no temporary blob and server-side copy
    are needed; the size is verified afterwards.
    """
    loc = _loc(target, storage_options)
    if loc.is_local:
        with open_atomic(loc) as f:
            f.write(data)
        return
    with _explained(loc, "write"):
        loc.fs.pipe_file(loc.path, data, max_concurrency=TRANSFER_CONCURRENCY)
        size = loc.fs.size(loc.path)
        if size != len(data):
            raise OSError(f"size check failed after upload ({size} != {len(data)} bytes)")


def write_file(target: "Location | str", local_path: str,
               storage_options: Optional[Mapping[str, Any]] = None) -> None:
    """Copy the local file ``local_path`` to ``target`` atomically, streamed (never whole in
    memory). On Azure one upload of blocks straight to the final blob, committed at once (as
    :func:`write_bytes`); the size is verified afterwards."""
    loc = _loc(target, storage_options)
    if loc.is_local:
        from sparkhvd.common.fileio import atomic_copy

        atomic_copy(local_path, loc.path)
        return
    expected = os.path.getsize(local_path)
    with _explained(loc, "write"):
        loc.fs.put_file(local_path, loc.path, max_concurrency=TRANSFER_CONCURRENCY)
        size = loc.fs.size(loc.path)
        if size != expected:
            raise OSError(f"size check failed after upload ({size} != {expected} bytes)")


def write_or_spill(target: "Location | str", data: bytes, spill_dir: str,
                   storage_options: Optional[Mapping[str, Any]] = None) -> str:
    """Write ``data``; if that fails, keep it under ``spill_dir`` and raise a StorageError that
    says where. Returns the URL written."""
    loc = _loc(target, storage_options)
    try:
        write_bytes(loc, data)
        return loc.url
    except Exception as exc:  # noqa: BLE001 - whatever failed, the bytes must not be lost
        name = loc.path.rstrip("/").rsplit("/", 1)[-1] or "data.bin"
        os.makedirs(spill_dir, exist_ok=True)
        spilled = os.path.join(os.path.abspath(spill_dir), name)
        write_bytes(spilled, data)
        raise StorageError(f"Could not write {public_url(loc.url)}: {_cause(exc)}. Nothing is "
                           f"lost: the {len(data)} bytes are kept at {spilled}.",
                           spilled_to=spilled) from None


def _cause(exc: BaseException) -> str:
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
    if re.search(r"AuthorizationFailure|AuthenticationFailed|failed to authenticate|"
                 r"AuthorizationPermissionMismatch|not authorized|403", text, re.I):
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
    return f"{where}: {_cause(exc)}"


@contextlib.contextmanager
def _explained(loc: Location, action: str) -> Iterator[None]:
    try:
        yield
    except (StorageError, KeyboardInterrupt, FileNotFoundError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise StorageError(f"Could not {action} {public_url(loc.url)}: {diagnose(loc, exc)}. "
                           f"({_cause(exc)})") from None


def preflight(target: "Location | str", storage_options: Optional[Mapping[str, Any]] = None, *,
              timeout_s: float = PREFLIGHT_TIMEOUT_S) -> Location:
    """Write and delete a small object under ``target`` (a folder URL) before training.

    Raises:
        StorageError: naming the URL (without secrets) and the likely cause, within
            ``timeout_s`` seconds.
    """
    loc = _loc(target, storage_options)
    probe = loc.child(f".sparkhvd-preflight-{uuid.uuid4().hex[:12]}")

    def attempt() -> None:
        if loc.is_local:
            os.makedirs(loc.path, exist_ok=True)
        probe.fs.pipe_file(probe.path, b"sparkhvd preflight")
        probe.fs.rm(probe.path)

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sparkhvd-preflight")
    try:
        pool.submit(attempt).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise StorageError(f"Storage pre-flight for {public_url(loc.url)} got no answer in "
                           f"{timeout_s:.0f} s: cannot reach the storage endpoint of account "
                           f"{loc.account!r}; check the account name, endpoint and network.") from None
    except Exception as exc:  # noqa: BLE001
        raise StorageError(f"Storage pre-flight failed for {public_url(loc.url)}: "
                           f"{diagnose(loc, exc)}. ({_cause(exc)})") from None
    finally:
        pool.shutdown(wait=False)
    return loc


#: How long a delegated credential stays valid (long runs may set storage_options
#: ``delegate_expiry_s``): the SAS tokens sparkhvd mints for executors and ranks.
DELEGATE_EXPIRY_S = 24 * 3600


def delegate(url: str, storage_options: Optional[Mapping[str, Any]] = None, *, write: bool,
             expiry_s: Optional[float] = None) -> dict[str, Any]:
    """Storage options for *another* process (an executor, a rank) to reach ``url``'s container,
    without the credentials the driver holds.

    Local paths need none (``{}``). For Azure, a SAS token scoped to the container, valid for
    ``expiry_s``, allowing read+list (and write/create/add/delete with ``write=True``): minted
    from the account key (service SAS) or, with an Azure AD credential, from a user delegation
    key. A SAS token the user passed is passed on as is. The token is registered for redaction.

    Raises:
        StorageError: no credential that can mint a SAS (naming the fix).
    """
    import datetime as _dt

    loc = resolve(url, storage_options)
    if loc.is_local:
        return {}
    given = dict(storage_options or {})
    opts = _azure_options(loc.account, given, os.environ)
    retry = {k: v for k, v in (storage_options or {}).items() if k in RETRIES}
    endpoint = None
    key = opts.get("account_key")
    if opts.get("connection_string"):
        parts = dict(p.split("=", 1) for p in opts["connection_string"].split(";") if "=" in p)
        endpoint = parts.get("BlobEndpoint")
        key = key or parts.get("AccountKey")
        account = parts.get("AccountName") or loc.account
        sas = parts.get("SharedAccessSignature")
    else:
        account = opts.get("account_name") or loc.account
        sas = opts.get("sas_token")
    if not sas:
        from azure.storage.blob import ContainerSasPermissions, generate_container_sas

        now = _dt.datetime.now(_dt.timezone.utc)
        expiry = now + _dt.timedelta(seconds=expiry_s or
                                     float(given.get("delegate_expiry_s", DELEGATE_EXPIRY_S)))
        permission = ContainerSasPermissions(read=True, list=True, write=write, create=write,
                                             add=write, delete=write)
        if key:
            sas = generate_container_sas(str(account), str(loc.container), account_key=key,
                                         permission=permission, expiry=expiry,
                                         start=now - _dt.timedelta(minutes=5))
        elif opts.get("credential") is not None or opts.get("anon") is False:
            from azure.storage.blob import BlobServiceClient

            credential = opts.get("credential")
            if credential is None:
                from azure.identity import DefaultAzureCredential

                credential = DefaultAzureCredential()
            service = BlobServiceClient(endpoint or f"https://{account}.blob.core.windows.net",
                                        credential=credential)
            with _explained(loc, "get a user delegation key for"):
                delegation = service.get_user_delegation_key(now - _dt.timedelta(minutes=5),
                                                             expiry)
            sas = generate_container_sas(str(account), str(loc.container),
                                         user_delegation_key=delegation,
                                         permission=permission, expiry=expiry,
                                         start=now - _dt.timedelta(minutes=5))
        else:
            raise StorageError(f"Cannot hand {public_url(url)} to the executors: no account key, "
                               "SAS token or Azure AD credential to derive a scoped token from. "
                               "Pass storage_options with account_key, connection_string, "
                               "sas_token or credential.")
    sas = sas.lstrip("?")
    remember_secret(sas)
    for part in sas.split("&"):
        if part.startswith("sig="):
            remember_secret(part[4:])
    if endpoint:
        return {"connection_string": f"BlobEndpoint={endpoint};SharedAccessSignature={sas}",
                **retry}
    return {"account_name": account, "sas_token": sas, **retry}
