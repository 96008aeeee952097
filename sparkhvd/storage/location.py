"""Where a URL points and with which credentials: :class:`Location`, :func:`resolve`
(credentials from ``storage_options``, then the environment, then adlfs' chain) and the
bounded retries every Azure operation gets (:data:`RETRIES`: a refused or unreachable endpoint
is reported within seconds, throttling and server errors -- 429/5xx -- are retried; set per
call in ``storage_options``: ``retry_total``, ``retry_connect``, ``retry_backoff_s``)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional
from urllib.parse import urlparse

import fsspec

from sparkhvd.common.redaction import remember_secret

__side__ = "shared"


AZURE_SCHEMES = ("abfss", "abfs", "az")


#: The default retry budget of every Azure operation (``storage_options`` keys override it):
#: ``retry_total`` attempts in all, of which ``retry_connect`` for a refused/unreachable
#: endpoint, waiting ``retry_backoff_s`` (growing) between them.
RETRIES = {"retry_total": 4, "retry_connect": 1, "retry_backoff_s": 1.0}


#: storage_options keys that are sparkhvd's own (never passed to adlfs).
_OWN_KEYS = frozenset(RETRIES) | {"delegate_expiry_s"}


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


def azure_options(account: Optional[str], storage_options: Mapping[str, Any],
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
    opts = azure_options(account, storage_options or {}, environ)
    fs = fsspec.filesystem("abfs", skip_instance_cache=True, **opts)
    retries = {**RETRIES, **{k: v for k, v in (storage_options or {}).items() if k in RETRIES}}
    from sparkhvd.common.patches import set_storage_retries

    set_storage_retries(fs, total=int(retries["retry_total"]),
                        connect=int(retries["retry_connect"]),
                        backoff_s=float(retries["retry_backoff_s"]))
    path = f"{container}/{parsed.path.lstrip('/')}".rstrip("/")
    return Location(url, fs, path, account=opts.get("account_name") or account,
                    container=container)


def as_location(target: "Location | str", storage_options: Optional[Mapping[str, Any]]) -> Location:
    return target if isinstance(target, Location) else resolve(target, storage_options)
