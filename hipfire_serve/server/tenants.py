"""Tenants, listed in a TOML file: who may call the server, how fast, with what share of slots.

    [[tenants]]
    name = "acme"                          # metric label, log name; [A-Za-z0-9_.-]
    api_key_sha256 = ["<64 hex digits>"]   # `hipfire-serve hash-key KEY` prints one
    weight = 2.0                           # share in the scheduler's fair admission
    max_concurrency = 16                   # live slots at once (0: no cap beyond the pool)
    priority = 0                           # higher is admitted first when slots are scarce
    requests_per_minute = 600              # token bucket (0: unlimited)
    tokens_per_minute = 200000             # prompt + max_tokens, refunded on finish (0: unlimited)
    speculation = ["auto", "on", "off"]    # modes this tenant may ask for

Keys are stored only as sha256 digests, so the file can be shared without leaking credentials;
a request's `Authorization: Bearer <key>` is hashed and looked up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hipfire_serve.types import SPECULATION_CHOICES

DEFAULT_TENANT = "default"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_KEYS = {
    "name",
    "api_key_sha256",
    "weight",
    "max_concurrency",
    "priority",
    "requests_per_minute",
    "tokens_per_minute",
    "speculation",
}


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Tenant:
    name: str
    api_key_sha256: tuple[str, ...] = ()
    weight: float = 1.0
    max_concurrency: int = 0
    priority: int = 0
    requests_per_minute: float = 0.0
    tokens_per_minute: float = 0.0
    speculation: tuple[str, ...] = SPECULATION_CHOICES

    def speculation_mode(self, requested: str) -> str:
        """The mode to run `requested` with; ValueError when the tenant may not use it."""
        if requested in self.speculation:
            return requested
        if requested == "auto":
            # "auto" means "whatever the server picks": give the tenant's own first choice.
            return self.speculation[0]
        raise ValueError(
            f"speculation {requested!r} is not allowed for this API key "
            f"(allowed: {', '.join(self.speculation)})"
        )

    def to_spec(self):
        """The scheduler's view (fair admission)."""
        from scheduler.tenants import TenantSpec

        return TenantSpec(
            name=self.name,
            weight=self.weight,
            max_concurrency=self.max_concurrency,
            priority=self.priority,
        )


def parse_tenants(text: str, source: str = "tenants file") -> list[Tenant]:
    """TOML text -> tenants; ValueError with a one-line reason naming the entry."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source}: not valid TOML ({exc})") from None
    entries = doc.get("tenants")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: needs at least one [[tenants]] entry")
    tenants: list[Tenant] = []
    owner_of_digest: dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: tenants[{i}]"
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
        tenant = _tenant_from_entry(entry, where)
        if any(t.name == tenant.name for t in tenants):
            raise ValueError(f"{where}: duplicate name {tenant.name!r}")
        for digest in tenant.api_key_sha256:
            if digest in owner_of_digest:
                raise ValueError(
                    f"{where}: key digest {digest[:12]}... also belongs to "
                    f"{owner_of_digest[digest]!r}"
                )
            owner_of_digest[digest] = tenant.name
        tenants.append(tenant)
    return tenants


def _tenant_from_entry(entry: dict, where: str) -> Tenant:
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{where}: name must be 1-64 characters of [A-Za-z0-9_.-]")
    where = f"{where} ({name})"
    digests = entry.get("api_key_sha256", [])
    if isinstance(digests, str):
        digests = [digests]
    if not isinstance(digests, list) or not digests:
        raise ValueError(f"{where}: api_key_sha256 must list at least one sha256 hex digest")
    digests = [d.lower() if isinstance(d, str) else d for d in digests]
    for d in digests:
        if not isinstance(d, str) or not _DIGEST_RE.match(d):
            raise ValueError(
                f"{where}: api_key_sha256 entries must be 64 hex digits "
                "(use `hipfire-serve hash-key KEY`)"
            )
    numbers = {
        "weight": (entry.get("weight", 1.0), 1e-9),
        "max_concurrency": (entry.get("max_concurrency", 0), 0),
        "requests_per_minute": (entry.get("requests_per_minute", 0), 0),
        "tokens_per_minute": (entry.get("tokens_per_minute", 0), 0),
    }
    for key, (value, lowest) in numbers.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < lowest:
            raise ValueError(f"{where}: {key} must be a number >= {lowest:g}, got {value!r}")
    if not isinstance(numbers["max_concurrency"][0], int):
        raise ValueError(f"{where}: max_concurrency must be an integer")
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"{where}: priority must be an integer, got {priority!r}")
    modes = entry.get("speculation", list(SPECULATION_CHOICES))
    if not isinstance(modes, list) or not modes or any(m not in SPECULATION_CHOICES for m in modes):
        raise ValueError(
            f"{where}: speculation must be a non-empty list of {', '.join(SPECULATION_CHOICES)}"
        )
    return Tenant(
        name=name,
        api_key_sha256=tuple(digests),
        weight=float(numbers["weight"][0]),
        max_concurrency=int(numbers["max_concurrency"][0]),
        priority=priority,
        requests_per_minute=float(numbers["requests_per_minute"][0]),
        tokens_per_minute=float(numbers["tokens_per_minute"][0]),
        speculation=tuple(dict.fromkeys(modes)),
    )


def with_api_keys(tenants: Sequence[Tenant] | None, api_keys: Sequence[str]) -> list[Tenant] | None:
    """The tenants once `--api-key` keys join them: the keys belong to the tenant `default`,
    the tenants file's own if it names one (its limits and weight apply), else a new one with
    none. Without keys the tenants are unchanged (None: open access). ValueError when a key
    is also a file tenant's: a request must map to one tenant."""
    if not api_keys:
        return None if tenants is None else list(tenants)
    digests = tuple(dict.fromkeys(hash_key(key) for key in api_keys))
    tenants = list(tenants or ())
    for tenant in tenants:
        if tenant.name != DEFAULT_TENANT and set(digests) & set(tenant.api_key_sha256):
            raise ValueError(f"--api-key: a key is also tenant {tenant.name!r}'s in --tenants")
    for i, tenant in enumerate(tenants):
        if tenant.name == DEFAULT_TENANT:
            keys = tuple(dict.fromkeys((*tenant.api_key_sha256, *digests)))
            tenants[i] = dataclasses.replace(tenant, api_key_sha256=keys)
            return tenants
    return [*tenants, Tenant(name=DEFAULT_TENANT, api_key_sha256=digests)]


def load_tenants(path: str | Path) -> list[Tenant]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"--tenants {path}: cannot read ({exc.strerror})") from None
    return parse_tenants(text, source=f"--tenants {path}")


class TokenBucket:
    """Classic token bucket: holds up to `capacity`, refills `capacity` per `period_s`.

    A request that needs more than the bucket holds waits; one that needs more than the whole
    capacity can never pass (`take` reports that with an infinite wait).
    """

    def __init__(self, capacity: float, period_s: float = 60.0, now: float = 0.0) -> None:
        self.capacity = float(capacity)
        self.rate_per_s = self.capacity / period_s
        self.level = self.capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
            self.updated = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0.0: available now)."""
        self._refill(now)
        if amount > self.capacity:
            return float("inf")
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate_per_s

    def take(self, amount: float) -> None:
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


class RateLimitExceeded(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass
class _TenantLimits:
    requests: TokenBucket | None
    tokens: TokenBucket | None


@dataclass
class TenantRegistry:
    """Key lookup and rate limiting. `open` (no tenants file) maps everything to 'default'."""

    tenants: Sequence[Tenant]
    open: bool = False
    clock: Callable[[], float] = time.monotonic
    _by_digest: dict[str, Tenant] = field(default_factory=dict, init=False)
    _limits: dict[str, _TenantLimits] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        now = self.clock()
        for tenant in self.tenants:
            for digest in tenant.api_key_sha256:
                self._by_digest[digest] = tenant
            self._limits[tenant.name] = _TenantLimits(
                requests=TokenBucket(tenant.requests_per_minute, 60.0, now)
                if tenant.requests_per_minute > 0
                else None,
                tokens=TokenBucket(tenant.tokens_per_minute, 60.0, now)
                if tenant.tokens_per_minute > 0
                else None,
            )

    @classmethod
    def open_access(cls) -> TenantRegistry:
        return cls(tenants=(Tenant(name=DEFAULT_TENANT),), open=True)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization` header value, or None (-> 401)."""
        if self.open:
            return self.tenants[0]
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = hash_key(key.strip())
        tenant = self._by_digest.get(digest)
        # Constant-time confirmation so the dict lookup is the only data-dependent step.
        if tenant is None or not any(hmac.compare_digest(digest, d) for d in tenant.api_key_sha256):
            return None
        return tenant

    def admit(self, tenant: Tenant, num_tokens: int) -> None:
        """Charges one request and `num_tokens` to the tenant's buckets, or raises
        RateLimitExceeded (-> 429) without charging anything."""
        limits = self._limits.get(tenant.name)
        if limits is None:
            return
        with self._lock:
            now = self.clock()
            wait_req = limits.requests.wait_s(1, now) if limits.requests else 0.0
            wait_tok = limits.tokens.wait_s(num_tokens, now) if limits.tokens else 0.0
            if wait_tok == float("inf"):
                raise RateLimitExceeded(
                    f"request needs {num_tokens} tokens (prompt + max_tokens), over the "
                    f"tokens_per_minute limit of {tenant.tokens_per_minute:g}",
                    60.0,
                )
            if wait_req > 0:
                raise RateLimitExceeded(
                    f"rate limit of {tenant.requests_per_minute:g} requests per minute reached",
                    wait_req,
                )
            if wait_tok > 0:
                raise RateLimitExceeded(
                    f"rate limit of {tenant.tokens_per_minute:g} tokens per minute reached",
                    wait_tok,
                )
            if limits.requests:
                limits.requests.take(1)
            if limits.tokens:
                limits.tokens.take(num_tokens)

    def refund_tokens(self, tenant: Tenant, num_tokens: int) -> None:
        """Gives back tokens charged but not generated (finished before max_tokens)."""
        limits = self._limits.get(tenant.name)
        if limits is None or limits.tokens is None or num_tokens <= 0:
            return
        with self._lock:
            limits.tokens.give_back(num_tokens)


def hash_key_main(argv: list[str]) -> int:
    """`hipfire-serve hash-key KEY` (or the key on stdin): prints the key's sha256 digest for
    the tenants file's `api_key_sha256`."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: hipfire-serve hash-key [KEY]   (reads the key from stdin without KEY)")
        return 0
    if len(argv) > 1:
        print("hipfire-serve hash-key: takes one key", file=sys.stderr)
        return 2
    key = argv[0] if argv else sys.stdin.readline().rstrip("\r\n")
    if not key:
        print("hipfire-serve hash-key: empty key", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0
