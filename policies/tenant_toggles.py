"""Which tenants run graphs when the configuration's `tenants` and an operator's changes disagree.

A redeploy may change `tenants`; the controller's state file holds what operators set since. The
rule is pure (dicts in, dict out) so every case is a millisecond test.
"""

from __future__ import annotations


def reconciled_toggles(
    toggles: dict[str, bool], configured_before: dict[str, bool], configured: dict[str, bool]
) -> dict[str, bool]:
    """Tenant toggles under a configuration whose `tenants` may have changed since the state was
    made: a tenant whose configured value is new or changed takes it (the configuration wins, as
    for swaps); one whose configured value stayed keeps what it has (an operator's change stays);
    one the configuration no longer names goes, unless an operator had set it otherwise."""
    kept = {t: v for t, v in toggles.items() if t not in configured and v != configured_before.get(t, True)}
    for tenant, value in configured.items():
        same = tenant in configured_before and configured_before[tenant] == value and tenant in toggles
        kept[tenant] = toggles[tenant] if same else value
    return kept
