"""Keeping secrets out of every text that leaves a rank or the driver: messages, logs, records.

Two rules, applied together by :func:`redact`:

- *by shape*: account keys, SAS signatures, connection-string parts, bearer tokens and
  ``password=...``-style pairs are masked wherever they appear;
- *by value*: every value registered with :func:`remember_secret` -- the storage credentials the
  driver resolved, and the value of every driver environment variable whose *name* looks like a
  credential (:func:`remember_environment`) -- is masked wherever it appears, whatever its shape.

Shared by the driver and the rank side (no imports beyond the standard library).
"""
from __future__ import annotations

import re
import threading
from typing import Mapping, Optional

__side__ = "common"

#: Names that look like credentials: never forwarded to ranks implicitly, always redacted.
SECRET_NAME = re.compile(r"(?i)(KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|CONNECTION_STRING|SAS)")

_SECRET_PATTERNS = [
    re.compile(r"(?i)(AccountKey=)[^;\s\"']+"),
    re.compile(r"(?i)(SharedAccessSignature=)[^;\s\"']+"),
    re.compile(r"(?i)([?&]sig=)[^&\s\"']+"),
    re.compile(r"(?i)(Bearer\s+)[A-Za-z0-9\-._~+/]+=*"),
    re.compile(r"(?i)((?:account_key|sas_token|credential|client_secret|password)['\"]?\s*[:=]\s*"
               r"['\"]?)[^'\"\s,}]+"),
]
#: Values shorter than this are not masked by value (too likely to be ordinary words).
MIN_SECRET_LEN = 6

_known: set[str] = set()
_lock = threading.Lock()
_sorted: list[str] = []


def remember_secret(value: Optional[str]) -> None:
    """Register a secret value so that :func:`redact` masks it wherever it appears."""
    global _sorted
    if not isinstance(value, str) or len(value) < MIN_SECRET_LEN:
        return
    with _lock:
        if value in _known:
            return
        _known.add(value)
        _sorted = sorted(_known, key=len, reverse=True)


def remember_environment(environ: Mapping[str, str]) -> None:
    """Register the values of every variable whose name looks like a credential.

    Called on the driver before a run: whatever a rank prints, raises or records, the driver's
    ``MY_API_TOKEN=...`` never reaches a console, a log file or ``run.json``.
    """
    for name, value in environ.items():
        if SECRET_NAME.search(name):
            remember_secret(value)
            if name.upper().endswith("CONNECTION_STRING"):
                for part in value.split(";"):
                    key, _, secret = part.partition("=")
                    if key.lower() in ("accountkey", "sharedaccesssignature"):
                        remember_secret(secret)


def redact(text: str) -> str:
    """``text`` with every known secret value and every secret-shaped substring masked."""
    if not text:
        return text
    for secret in _sorted:
        if secret in text:
            text = text.replace(secret, "***")
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + "***", text)
    return text
