"""A short-lived SAS a rank may use instead of the account's own secret (:func:`delegate`)."""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from sparkhvd.common.errors import StorageError
from sparkhvd.common.redaction import remember_secret
from sparkhvd.storage.diagnosis import explained
from sparkhvd.storage.location import RETRIES, azure_options, public_url, resolve

__side__ = "shared"


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
    opts = azure_options(loc.account, given, os.environ)
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
            with explained(loc, "get a user delegation key for"):
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
