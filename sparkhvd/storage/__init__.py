"""One small API over fsspec for local paths, ``file://``, ``abfss://`` and ``az://``; this face
only hands names on: :mod:`~sparkhvd.storage.location` (where a URL points, with which
credentials: ``storage_options`` first, then the ``AZURE_STORAGE_*`` variables, then adlfs'
default chain; bounded retries, :data:`RETRIES`), :mod:`~sparkhvd.storage.files` (reads,
atomic writes and what a killed one leaves, :func:`write_or_spill`'s local spill,
:func:`preflight` before training), :mod:`~sparkhvd.storage.diagnosis` (what a failure means)
and :mod:`~sparkhvd.storage.delegation` (a short-lived SAS for the ranks). Secrets never appear
in messages (:func:`sparkhvd.common.redaction.redact`).
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
    size,
    write_bytes,
    write_file,
    write_or_spill,
)
from sparkhvd.storage.location import RETRIES, Location, public_url, resolve

__side__ = "shared"

__all__ = ["StorageError", "redact", "remember_secret", "resolve", "read_bytes", "read_range",
           "write_bytes", "open_atomic", "exists", "listdir", "delete", "preflight", "write_or_spill",
           "public_url", "Location", "RETRIES", "write_file", "delegate", "diagnose", "remove_torn",
           "size"]
