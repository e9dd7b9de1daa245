"""The rule that reconciles a redeployed `tenants` with operators' changes (`policies/tenant_toggles.py`)."""

import pytest

from policies.tenant_toggles import reconciled_toggles


@pytest.mark.parametrize(
    ("toggles", "before", "configured", "expected"),
    [
        # unchanged configuration: an operator's change stays
        ({"a": True}, {"a": False}, {"a": False}, {"a": True}),
        # the configured value changed: the configuration wins over the operator
        ({"a": True}, {"a": False}, {"a": True}, {"a": True}),
        ({"a": False}, {"a": True}, {"a": False}, {"a": False}),
        ({"a": True}, {"a": True}, {"a": False}, {"a": False}),
        # a tenant new to the configuration takes its value even if the state had one
        ({"a": True}, {}, {"a": False}, {"a": False}),
        ({}, {}, {"a": False}, {"a": False}),
        # a tenant the configuration drops goes, unless an operator set it otherwise
        ({"a": False}, {"a": False}, {}, {}),
        ({"a": True}, {"a": False}, {}, {"a": True}),
        # a tenant only an operator ever named stays as set when it differs from the default (on)
        ({"b": False}, {}, {}, {"b": False}),
        ({"b": True}, {}, {}, {}),
        # the configured value stayed but the state lost the tenant: the configured value
        ({}, {"a": False}, {"a": False}, {"a": False}),
    ],
)
def test_reconciled_toggles(toggles, before, configured, expected):
    assert reconciled_toggles(toggles, before, configured) == expected
