"""What a failed storage call is said to mean (sparkhvd.storage.diagnosis): the one sentence a
user reads, so each cause must be told from the others by what the error really says."""
from __future__ import annotations

import pytest

from sparkhvd.storage.diagnosis import diagnose
from sparkhvd.storage.location import resolve

URL = "abfss://models@acct.dfs.core.windows.net/runs"


class ServiceRequestError(Exception):
    """Named as azure-core's: the client never reached the service."""


@pytest.mark.parametrize("port", [40393, 14030, 4030, 54037])
def test_an_endpoint_that_refuses_is_unreachable_whatever_its_port(port):
    """A port's digits are no HTTP 403: 127.0.0.1:40393 refusing is not a rejected key."""
    exc = ServiceRequestError(f"Cannot connect to host 127.0.0.1:{port} ssl:default "
                              f"[Connect call failed ('127.0.0.1', {port})]")
    assert diagnose(resolve(URL), exc).startswith("cannot reach the storage endpoint")


@pytest.mark.parametrize("message", [
    "Server failed to authenticate the request. ErrorCode:AuthenticationFailed",
    "This request is not authorized to perform this operation. (403)",
    "Operation returned an invalid status 403 Forbidden",
])
def test_a_rejected_key_is_said_to_be_rejected(message):
    assert diagnose(resolve(URL), Exception(message)).startswith("the credentials were rejected")
