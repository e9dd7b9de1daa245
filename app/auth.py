"""Bearer-token checks for tenants (/v1) and operators (/admin), in constant time."""

from __future__ import annotations

import hmac

OPEN_TENANT = "default"


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def tenant_for(token: str | None, keys: dict[str, str]) -> str | None:
    """The tenant owning this API key; every key is compared, so timing does not reveal which matched.
    With no keys configured the API is open and everyone is tenant `default`."""
    if not keys:
        return OPEN_TENANT
    found = None
    candidate = (token or "").encode()
    for key, tenant in keys.items():
        if hmac.compare_digest(candidate, key.encode()):
            found = tenant
    return found


def admin_ok(token: str | None, admin_token: str) -> bool:
    return hmac.compare_digest((token or "").encode(), admin_token.encode())
