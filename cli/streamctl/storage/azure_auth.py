"""Which Azure credential applies, from the environment alone: the rules `az://` stores authenticate by
(storage/azure.py) and `serve` passes on to vLLM's streamer (serve/plan.py). No SDK import, no request.

First that applies: AZURE_STORAGE_CONNECTION_STRING (when its account is the one asked for), an account key
(AZURE_STORAGE_KEY or AZURE_STORAGE_ACCOUNT_KEY), a SAS token (AZURE_STORAGE_SAS_TOKEN), else Microsoft Entra ID
through azure.identity.DefaultAzureCredential.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from streamctl.errors import UsageError


@dataclass(frozen=True)
class AzureAuth:
    """The credential chosen for a store (no secrets in repr: it may end up in logs)."""

    method: str  # "connection string", "account key", "SAS token" or "DefaultAzureCredential"
    account: str | None
    secret: str | None = field(default=None, repr=False)


def connection_string_fields(connection_string: str) -> dict[str, str]:
    """A connection string's `Name=value` fields, names as written (values may hold `=`, as base64 keys do)."""
    fields = {}
    for item in connection_string.split(";"):
        name, separator, value = item.partition("=")
        if separator and name.strip():
            fields[name.strip()] = value.strip()
    return fields


def connection_string_account(connection_string: str) -> str | None:
    """The AccountName field, however its name is capitalised."""
    fields = connection_string_fields(connection_string).items()
    return next((value for name, value in fields if name.lower() == "accountname" and value), None)


def choose_auth(url_account: str | None, option_account: str | None, environ: Mapping[str, str]) -> AzureAuth:
    """Pick credentials in the documented order; no request is made."""
    account = url_account or option_account or environ.get("AZURE_STORAGE_ACCOUNT_NAME") or None
    connection_string = environ.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if connection_string:
        conn_account = connection_string_account(connection_string)
        # A connection string for another account must not silently redirect the upload there.
        if account is None or conn_account is None or conn_account.lower() == account.lower():
            return AzureAuth("connection string", account or conn_account, connection_string)
    if account is None:
        raise UsageError(
            "no Azure storage account given",
            hint="set AZURE_STORAGE_ACCOUNT_NAME (or AZURE_STORAGE_CONNECTION_STRING), or use "
            "https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX",
        )
    key = environ.get("AZURE_STORAGE_KEY") or environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    if key:
        return AzureAuth("account key", account, key.strip())
    sas = environ.get("AZURE_STORAGE_SAS_TOKEN")
    if sas:
        return AzureAuth("SAS token", account, sas.strip().lstrip("?"))
    return AzureAuth("DefaultAzureCredential", account)
