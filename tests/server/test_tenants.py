"""Tenants file parsing, key lookup and token-bucket rate limits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hipfire_serve.server.tenants import (
    RateLimitExceeded,
    Tenant,
    TenantRegistry,
    TokenBucket,
    hash_key,
    parse_tenants,
)

GOOD = f"""
[[tenants]]
name = "acme"
api_key_sha256 = ["{hash_key("k1")}", "{hash_key("k2").upper()}"]
weight = 2
max_concurrency = 4
priority = 1
requests_per_minute = 60
tokens_per_minute = 1000
speculation = ["off", "auto"]

[[tenants]]
name = "free"
api_key_sha256 = "{hash_key("k3")}"
"""


def test_parse_and_map_to_scheduler_specs():
    acme, free = parse_tenants(GOOD)
    assert acme.name == "acme" and acme.weight == 2.0 and acme.max_concurrency == 4
    assert acme.api_key_sha256 == (hash_key("k1"), hash_key("k2"))  # digests lower-cased
    assert acme.speculation == ("off", "auto")
    assert free.speculation == ("auto", "on", "off") and free.requests_per_minute == 0
    spec = acme.to_spec()
    assert (spec.name, spec.weight, spec.max_concurrency, spec.priority) == ("acme", 2.0, 4, 1)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[[tenants]]\nname='a'\n", "api_key_sha256"),
        ("[[tenants]]\nname='a b'\napi_key_sha256=['" + "0" * 64 + "']\n", "name must be"),
        ("[[tenants]]\nname='a'\napi_key_sha256=['abc']\n", "64 hex digits"),
        ("[[tenants]]\nname='a'\napi_key_sha256=['" + "0" * 64 + "']\nweight=0\n", "weight"),
        (
            "[[tenants]]\nname='a'\napi_key_sha256=['" + "0" * 64 + "']\nspeculation=['x']\n",
            "speculation",
        ),
        ("[[tenants]]\nname='a'\napi_key_sha256=['" + "0" * 64 + "']\nrate=1\n", "unknown key"),
        (
            "[[tenants]]\nname='a'\napi_key_sha256=['" + "0" * 64 + "']\n"
            "[[tenants]]\nname='b'\napi_key_sha256=['" + "0" * 64 + "']\n",
            "also belongs",
        ),
        ("tenants = 1", "at least one"),
        ("[[tenants]\n", "not valid TOML"),
    ],
)
def test_bad_tenants_files_name_the_problem(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_tenants(text)


def test_authenticate_by_bearer_key():
    registry = TenantRegistry(parse_tenants(GOOD))
    assert registry.authenticate("Bearer k1").name == "acme"
    assert registry.authenticate("bearer  k2 ").name == "acme"
    assert registry.authenticate("Bearer k3").name == "free"
    for bad in (None, "", "Bearer", "Bearer wrong", "Basic k1", "k1"):
        assert registry.authenticate(bad) is None
    assert TenantRegistry.open_access().authenticate(None).name == "default"


def test_speculation_modes_of_a_tenant():
    tenant = Tenant(name="t", speculation=("off",))
    assert tenant.speculation_mode("off") == "off"
    assert tenant.speculation_mode("auto") == "off"
    with pytest.raises(ValueError, match="not allowed"):
        tenant.speculation_mode("on")


def test_rate_limits_answer_with_retry_after_and_refunds():
    now = [0.0]
    tenant = Tenant(
        name="t", api_key_sha256=(hash_key("k"),), requests_per_minute=2, tokens_per_minute=100
    )
    registry = TenantRegistry([tenant], clock=lambda: now[0])
    registry.admit(tenant, 40)
    registry.admit(tenant, 40)
    with pytest.raises(RateLimitExceeded, match="requests per minute") as info:
        registry.admit(tenant, 1)
    assert info.value.retry_after_s == pytest.approx(30.0)
    now[0] = 30.0  # one request and 50 tokens refilled
    with pytest.raises(RateLimitExceeded, match="tokens per minute"):
        registry.admit(tenant, 90)
    registry.refund_tokens(tenant, 40)
    registry.admit(tenant, 90)
    with pytest.raises(RateLimitExceeded, match="over the tokens_per_minute"):
        registry.admit(tenant, 101)


@given(
    capacity=st.integers(1, 1000),
    events=st.lists(st.tuples(st.floats(0, 30), st.integers(1, 200)), max_size=40),
)
def test_bucket_never_grants_more_than_capacity_plus_refill(capacity, events):
    """Over any window, granted amount <= capacity + rate * elapsed (the bucket invariant)."""
    bucket = TokenBucket(capacity, period_s=60.0, now=0.0)
    now = 0.0
    granted = 0.0
    for gap, amount in events:
        now += gap
        if bucket.wait_s(amount, now) == 0.0:
            bucket.take(amount)
            granted += amount
        assert 0 <= bucket.level <= capacity + 1e-9
    assert granted <= capacity + bucket.rate_per_s * now + 1e-6
