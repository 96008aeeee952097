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

This face only hands names on: :mod:`~sparkhvd.storage.location` (where a URL points, with
which credentials), :mod:`~sparkhvd.storage.files` (reads, atomic writes and what a killed
one leaves, spill, preflight), :mod:`~sparkhvd.storage.diagnosis` (what a failure means) and
:mod:`~sparkhvd.storage.delegation` (a short-lived SAS for the ranks).
"""
from sparkhvd.common.errors import StorageError
from sparkhvd.common.redaction import redact, remember_secret
from sparkhvd.storage.delegation import delegate
from sparkhvd.storage.diagnosis import diagnose
from sparkhvd.storage.files import (
    delete,
    exists,
    listdir,
    open_atomic,
    preflight,
    read_bytes,
    read_range,
    remove_torn,
    write_bytes,
    write_file,
    write_or_spill,
)
from sparkhvd.storage.location import RETRIES, Location, public_url, resolve

__side__ = "shared"

__all__ = ["StorageError", "redact", "remember_secret", "resolve", "read_bytes", "read_range",
           "write_bytes", "open_atomic", "exists", "listdir", "delete", "preflight", "write_or_spill",
           "public_url", "Location", "RETRIES", "write_file", "delegate", "diagnose", "remove_torn"]
