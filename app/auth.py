"""Bearer-token checks for tenants (/v1) and operators (/admin), in constant time."""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

OPEN_TENANT = "default"


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _owner(token: str | None, owners: dict[str, str]) -> str | None:
    """The owner of `token` in {secret: owner}; every secret is compared (constant time each, and
    no early exit), so timing does not reveal which one matched, or how far a guess got."""
    found = None
    candidate = (token or "").encode()
    for secret, owner in owners.items():
        if hmac.compare_digest(candidate, secret.encode()):
            found = owner
    return found


def tenant_for(token: str | None, keys: dict[str, str]) -> str | None:
    """The tenant owning this API key. With no keys configured the API is open and everyone is
    tenant `default`."""
    if not keys:
        return OPEN_TENANT
    return _owner(token, keys)


def admin_operator(token: str | None, tokens: dict[str, str]) -> str | None:
    """The name of the operator whose admin token this is ({token: name}), or None."""
    return _owner(token, tokens) if token else None


@dataclass(frozen=True)
class Operator:
    """Who made an admin call, as the audit log records it: the operator named by the admin token,
    and the address the call came from."""

    name: str
    client: str | None = None


@dataclass(frozen=True)
class AdminRefusal:
    """Why an admin call is refused: the HTTP status, the client's message, the reason logged."""

    status: int
    detail: str
    reason: str  # disabled | missing | wrong


def authorize_admin(
    authorization: str | None, tokens: dict[str, str], enable_hint: str, client: str, path: str
) -> Operator | AdminRefusal:
    """The operator an admin call comes from, or its refusal (401 without a bearer token, 403 with a
    wrong one or with the admin API disabled). Refusals are logged with the client's address, the
    path and the reason; never with the token or any part of it."""
    if not tokens:
        refusal = AdminRefusal(403, f"the admin API is disabled: {enable_hint}", "disabled")
    else:
        operator = admin_operator(bearer(authorization), tokens)
        if operator is not None:
            return Operator(operator, client)
        if bearer(authorization) is None:
            refusal = AdminRefusal(401, "admin bearer token required", "missing")
        else:
            refusal = AdminRefusal(403, "wrong admin token", "wrong")
    log.warning("admin call refused: reason=%s client=%s path=%r", refusal.reason, client, path)
    return refusal
