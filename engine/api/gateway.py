"""Gateway station: who is calling (API key → tenant) and may they (rate, concurrency, limits).

Tenants file (TOML)::

    [tenants.acme]
    key_sha256 = "<hex sha256 of the API key>"   # the key itself is never stored
    priority = 0                # lower is served first under --scheduling-policy priority
    max_concurrent = 8          # requests in flight at once
    requests_per_minute = 600
    max_prompt_tokens = 4096
    max_output_tokens = 1024

    [admin]                     # optional: the key of the admin endpoints (GET /admin/dump)
    key_sha256 = "<hex sha256 of the admin key>"

Keys are hashed on arrival and compared with every tenant's hash in constant time
(:func:`hmac.compare_digest`). One key for everyone is ``--api-key`` (or ``TOKENMILL_API_KEY``):
one tenant ``default`` with no limits (:func:`single_key_tenants`), its admin key
``--admin-key``. Without either the server runs in open local mode: one tenant ``local`` with
no limits, and it refuses to bind anything but a loopback address unless told
``--allow-unauthenticated``. On a keyed server every route but ``/health`` needs a key:
``/v1/*`` and ``/openapi.json`` a tenant's, ``/admin/*`` the admin key, and ``/metrics`` (its
series name tenants) the ``--metrics-key`` or the admin key, never a tenant's; ``--open-metrics``
opens it to any caller. In open local mode ``/metrics`` needs the ``--metrics-key`` when one is
set, else nothing (:meth:`Gateway.authenticate_metrics`).

Admin endpoints (:meth:`Gateway.authenticate_admin`) take only the ``[admin]`` key: a tenant key
gets 403, and with a tenants file but no ``[admin]`` table they are refused (403). In open local
mode they need no key but answer only clients on the loopback interface (the server binds
127.0.0.1 in that mode anyway; the check also holds if it is bound elsewhere behind a proxy).
"""

from __future__ import annotations

import hashlib
import hmac
import time
import tomllib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TokenmillError
from .errors import APIError


class TenantsFileError(TokenmillError):
    """The tenants file is missing or malformed."""


@dataclass
class Tenant:
    """One API tenant and its limits (0 = unlimited)."""

    name: str
    key_sha256: str = ""
    priority: int = 0
    max_concurrent: int = 0
    requests_per_minute: int = 0
    max_prompt_tokens: int = 0
    max_output_tokens: int = 0
    in_flight: int = 0
    recent: deque = field(default_factory=deque)  # arrival times (monotonic s) in the last minute


class Tenants(dict):
    """``{name: Tenant}`` as :func:`load_tenants` returns it, plus the ``[admin]`` key hash
    (``admin_key_sha256``, None without an ``[admin]`` table)."""

    admin_key_sha256: str | None = None


def hash_key(key: str) -> str:
    """Hex sha256 of an API key (what the tenants file stores)."""
    return hashlib.sha256(key.encode()).hexdigest()


def single_key_tenants(api_key: str, admin_key: str | None = None) -> Tenants:
    """The tenants of ``--api-key``: one tenant ``default`` holding that key, no limits; the
    admin endpoints take ``admin_key`` (None: they are refused, as without an ``[admin]``
    table)."""
    tenants = Tenants(default=Tenant(name="default", key_sha256=hash_key(api_key)))
    tenants.admin_key_sha256 = hash_key(admin_key) if admin_key else None
    return tenants


def _is_sha256_hex(digest: str) -> bool:
    return len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


def load_tenants(path: str | Path) -> Tenants:
    """Parse a tenants TOML file (its ``[tenants.<name>]`` tables and the optional ``[admin]``).

    Raises:
        TenantsFileError: unreadable file, no tenants, a bad hash or a bad limit (one line).
    """
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TenantsFileError(f"cannot read tenants file {p}: {exc}") from None
    entries = data.get("tenants")
    if not isinstance(entries, dict) or not entries:
        raise TenantsFileError(f"tenants file {p} has no [tenants.<name>] tables")
    tenants = Tenants()
    if "admin" in data:
        admin = data["admin"]
        if not isinstance(admin, dict):
            raise TenantsFileError(f"tenants file {p}: admin must be a table ([admin])")
        digest = str(admin.get("key_sha256", "")).lower()
        if not _is_sha256_hex(digest):
            raise TenantsFileError(f"tenants file {p}: admin.key_sha256 must be 64 hex digits")
        tenants.admin_key_sha256 = digest
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise TenantsFileError(f"tenants file {p}: tenants.{name} must be a table")
        digest = str(entry.get("key_sha256", "")).lower()
        if not _is_sha256_hex(digest):
            raise TenantsFileError(
                f"tenants file {p}: tenants.{name}.key_sha256 must be 64 hex digits"
            )
        limits = {}
        for k in (
            "priority",
            "max_concurrent",
            "requests_per_minute",
            "max_prompt_tokens",
            "max_output_tokens",
        ):
            v = entry.get(k, 0)
            if isinstance(v, bool) or not isinstance(v, int) or (v < 0 and k != "priority"):
                raise TenantsFileError(
                    f"tenants file {p}: tenants.{name}.{k} must be a non-negative integer"
                )
            limits[k] = v
        tenants[name] = Tenant(name=name, key_sha256=digest, **limits)
    return tenants


#: why no key opens ``/metrics`` on a keyed server without a metrics or admin key
_NO_METRICS_KEY = (
    " (this server has no metrics or admin key: start it with --metrics-key, or --open-metrics "
    "to let any caller scrape)"
)


class Gateway:
    """Authenticates requests and enforces per-tenant rate and concurrency limits.

    Args:
        tenants: from :func:`load_tenants`; None = open local mode.
        admin_key_sha256: the admin key's hash; default: the ``[admin]`` table of the tenants
            file (``tenants.admin_key_sha256``).
        metrics_key_sha256: ``--metrics-key``'s hash (:meth:`authenticate_metrics`).
        open_metrics: ``--open-metrics``: ``/metrics`` answers any caller on a keyed server.
    """

    def __init__(
        self,
        tenants: dict[str, Tenant] | None = None,
        admin_key_sha256: str | None = None,
        metrics_key_sha256: str | None = None,
        open_metrics: bool = False,
    ):
        self.open_mode = tenants is None
        self.tenants = tenants or {"local": Tenant(name="local")}
        self.admin_key_sha256 = admin_key_sha256 or getattr(tenants, "admin_key_sha256", None)
        self.metrics_key_sha256 = metrics_key_sha256
        self.open_metrics = open_metrics

    @property
    def metrics_keyed(self) -> bool:
        """Whether ``/metrics`` needs a key: a ``--metrics-key``, or a keyed server without
        ``--open-metrics``."""
        return bool(self.metrics_key_sha256) or not (self.open_mode or self.open_metrics)

    def authenticate_metrics(self, authorization: str | None) -> None:
        """Allow a ``/metrics`` scrape (``Authorization: Bearer <key>``; in Prometheus
        ``authorization: {credentials}``). It follows the server's auth: on a keyed server the
        ``--metrics-key`` or the admin key, never a tenant's (the series name every tenant);
        in open local mode, or with ``--open-metrics``, any caller, unless a ``--metrics-key``
        is set.

        Raises:
            APIError: 401 missing or wrong key (naming the flag when no key could pass).
        """
        if not self.metrics_keyed:
            return
        keys = [h for h in (self.metrics_key_sha256, self.admin_key_sha256) if h]
        if not authorization or not authorization.lower().startswith("bearer "):
            raise APIError(
                401,
                "missing metrics key: send 'Authorization: Bearer <metrics key>'"
                + ("" if keys else _NO_METRICS_KEY),
                code="invalid_api_key",
            )
        digest = hash_key(authorization[7:].strip())
        ok = False
        for key in keys:  # no early exit: every hash is compared
            ok = hmac.compare_digest(digest, key) or ok
        if not ok:
            raise APIError(
                401,
                "invalid metrics key" + ("" if keys else _NO_METRICS_KEY),
                code="invalid_api_key",
            )

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant owning the bearer key in ``authorization``.

        Raises:
            APIError: 401 when the key is missing or unknown.
        """
        if self.open_mode:
            return self.tenants["local"]
        if not authorization or not authorization.lower().startswith("bearer "):
            raise APIError(
                401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        digest = hash_key(authorization[7:].strip())
        found = None
        for tenant in self.tenants.values():  # no early exit: every hash is compared
            if hmac.compare_digest(digest, tenant.key_sha256):
                found = tenant
        if found is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return found

    def authenticate_admin(self, authorization: str | None, client_host: str | None = None) -> None:
        """Allow an admin request (``GET /admin/dump``) or raise.

        With a tenants file only the ``[admin]`` key is accepted. In open local mode no key is
        needed, but ``client_host`` (the peer address, when the caller knows it) must be a
        loopback address.

        Raises:
            APIError: 401 missing or unknown key; 403 a tenant's key ("admin only"), no
                ``[admin]`` key configured, or (open mode) a non-loopback client.
        """
        if self.open_mode:
            if client_host is not None and not is_loopback(client_host):
                raise APIError(
                    403,
                    "admin endpoints answer only local clients in open local mode "
                    "(configure an [admin] key in a tenants file)",
                    code="admin_only",
                )
            return
        if not self.admin_key_sha256:
            raise APIError(
                403,
                "no admin key configured (add [admin] key_sha256 to the tenants file)",
                code="admin_not_configured",
            )
        if not authorization or not authorization.lower().startswith("bearer "):
            raise APIError(
                401,
                "missing admin key: send 'Authorization: Bearer <admin key>'",
                code="invalid_api_key",
            )
        digest = hash_key(authorization[7:].strip())
        is_admin = hmac.compare_digest(digest, self.admin_key_sha256)
        is_tenant = False
        for tenant in self.tenants.values():  # no early exit: every hash is compared
            if hmac.compare_digest(digest, tenant.key_sha256):
                is_tenant = True
        if is_admin:
            return
        if is_tenant:
            raise APIError(403, "admin only: this is a tenant key", code="admin_only")
        raise APIError(401, "invalid admin key", code="invalid_api_key")

    def acquire(self, tenant: Tenant) -> None:
        """Count a request against the tenant's limits.

        Raises:
            APIError: 429 (with Retry-After) over the rate or the concurrency limit.
        """
        now = time.monotonic()
        while tenant.recent and now - tenant.recent[0] >= 60:
            tenant.recent.popleft()
        if tenant.requests_per_minute and len(tenant.recent) >= tenant.requests_per_minute:
            wait = 60 - (now - tenant.recent[0])
            raise APIError(
                429,
                f"tenant {tenant.name!r} is over its rate of {tenant.requests_per_minute} requests/min",
                code="rate_limit_exceeded",
                retry_after=wait,
            )
        if tenant.max_concurrent and tenant.in_flight >= tenant.max_concurrent:
            raise APIError(
                429,
                f"tenant {tenant.name!r} already has {tenant.in_flight} requests in flight (limit {tenant.max_concurrent})",
                code="concurrency_limit_exceeded",
                retry_after=1,
            )
        tenant.recent.append(now)
        tenant.in_flight += 1

    @staticmethod
    def release(tenant: Tenant) -> None:
        tenant.in_flight = max(0, tenant.in_flight - 1)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost`` (and an IPv4-mapped loopback)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)
