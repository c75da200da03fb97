"""Settings of ratelimits, read from ``settings.RATELIMITS`` when accessed.

Each setting is one typed property, so ``override_settings`` just works; values read on every
request, or costly to build (imported callables, parsed networks), are validated once and cached
until a ``setting_changed`` signal.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable
from typing import Any, TypeVar, cast

from django.conf import settings
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from .exceptions import ConfigurationError
from .rates import parse_duration

__all__ = ["FAIL_MODES", "HEADER_STYLES", "conf"]

T = TypeVar("T")

FAIL_MODES = ("open", "closed", "local")
HEADER_STYLES = ("ietf", "github", "both", "none")

DEFAULTS: dict[str, Any] = {
    # Where counters live: "memory" (one process only), "redis", or a dotted path to a Backend.
    "BACKEND": "memory",
    "REDIS_URL": "redis://127.0.0.1:6379/0",
    # The limiter's own client: tight timeouts, no retries (a consume is never sent twice).
    "REDIS_SOCKET_TIMEOUT": "50ms",
    "REDIS_CONNECT_TIMEOUT": "50ms",
    "KEY_PREFIX": "rl",
    # "redis": the script reads Redis TIME. "app": this process passes its clock, for Redis
    # flavours that reject TIME in scripts (then keep app servers' clocks in sync).
    "CLOCK": "redis",
    # Policies: see docs/configuration.md.
    "POLICY_SOURCE": "ratelimits.policies.SettingsPolicySource",
    # With the database source: how often workers reload policies while the store is unreachable
    # (otherwise they reload when the version stamp that comes back with every decision moves).
    "POLICY_POLL_INTERVAL": "5s",
    # ...and how often each worker compares its policies' version with the database's anyway.
    "POLICY_RECHECK_INTERVAL": "60s",
    "TIERS": {
        "anonymous": {"rate": "20/s", "burst": 40},
        "authenticated": {"rate": "100/s", "burst": 200},
    },
    "DEFAULT_TIERS": {"anonymous": "anonymous", "authenticated": "authenticated"},
    "TIER_FUNC": None,
    "DIMENSIONS": {},
    # Slots (concurrency per subject, the fleet's in-flight set) expire after this if the worker
    # holding them dies: keep it well above the slowest request.
    "SLOT_TTL": "60s",
    # The fleet load shedder (settings source; the database source reads the fleet settings row):
    # requests in flight the fleet can serve (None: no fleet shedding), and per priority class the
    # share of it above which that class is shed with a 503. Critical is never shed.
    "FLEET_CAPACITY": None,
    "SHED_THRESHOLDS": {"low": 60, "normal": 75, "high": 90},
    # The worker utilisation shedder: requests this process serves at once (its threads; None:
    # off). Lower classes are shed first, by SHED_THRESHOLDS, without asking Redis.
    "WORKER_CAPACITY": None,
    # Count every decision in per-minute usage counters, in the same round trip (see usage.py).
    "USAGE": True,
    "ENDPOINTS": {},
    "EXEMPT_ENDPOINTS": [],
    # Identity.
    "API_KEY_FUNC": "ratelimits.identity.default_api_key",
    # The model API keys are (``"app_label.Model"``): lets the admin suggest keys by name.
    "API_KEY_MODEL": None,
    "ORGANIZATION_FUNC": "ratelimits.identity.no_organization",
    "TRUSTED_PROXIES": [],
    "CLIENT_IP_HEADER": "HTTP_X_FORWARDED_FOR",
    "IPV6_PREFIX": 64,
    "HASH_KEY": None,
    # The contract.
    "HEADERS": "both",
    "RETRY_AFTER_JITTER": "0ms",
    # Failure handling.
    "DEFAULT_FAIL_MODE": "open",
    "LOCAL_FALLBACK_SHARE": 1.0,
    "BREAKER_WINDOW": 20,
    "BREAKER_MIN_CALLS": 5,
    "BREAKER_FAILURE_RATE": 0.5,
    "BREAKER_COOLDOWN": "2s",
}


class Settings:
    """Typed access to ``settings.RATELIMITS``; unknown keys are reported by the system checks."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def clear(self) -> None:
        self._cache.clear()

    @property
    def user_settings(self) -> dict[str, Any]:
        value = getattr(settings, "RATELIMITS", {})
        if not isinstance(value, dict):
            raise ConfigurationError(f"RATELIMITS must be a dict, got {type(value).__name__}")
        return value

    def get(self, name: str) -> Any:
        return self.user_settings.get(name, DEFAULTS[name])

    def _cached(self, name: str, build: Callable[[], T]) -> T:
        if name not in self._cache:
            self._cache[name] = build()
        return cast(T, self._cache[name])

    @property
    def backend(self) -> str:
        return str(self.get("BACKEND"))

    @property
    def redis_url(self) -> str:
        return str(self.get("REDIS_URL"))

    @property
    def redis_socket_timeout(self) -> float:
        return _seconds(self.get("REDIS_SOCKET_TIMEOUT"), "REDIS_SOCKET_TIMEOUT")

    @property
    def redis_connect_timeout(self) -> float:
        return _seconds(self.get("REDIS_CONNECT_TIMEOUT"), "REDIS_CONNECT_TIMEOUT")

    @property
    def key_prefix(self) -> str:
        prefix = str(self.get("KEY_PREFIX"))
        if not prefix or "{" in prefix or "}" in prefix or " " in prefix:
            raise ConfigurationError(
                f"RATELIMITS['KEY_PREFIX']: {prefix!r} must be non-empty, without braces or spaces"
            )
        return prefix

    @property
    def use_redis_time(self) -> bool:
        clock = self.get("CLOCK")
        if clock not in ("redis", "app"):
            raise ConfigurationError(f"RATELIMITS['CLOCK']: {clock!r} must be 'redis' or 'app'")
        return bool(clock == "redis")

    @property
    def policy_poll_interval(self) -> float:
        return self._cached(
            "POLICY_POLL_INTERVAL", lambda: _seconds(self.get("POLICY_POLL_INTERVAL"), "POLICY_POLL_INTERVAL")
        )

    @property
    def policy_recheck_interval(self) -> float:
        return self._cached(
            "POLICY_RECHECK_INTERVAL", lambda: _seconds(self.get("POLICY_RECHECK_INTERVAL"), "POLICY_RECHECK_INTERVAL")
        )

    @property
    def slot_ttl_us(self) -> int:
        return self._cached("SLOT_TTL", lambda: parse_duration(self.get("SLOT_TTL"), field="RATELIMITS['SLOT_TTL']"))

    @property
    def fleet_capacity(self) -> int | None:
        return self._cached("FLEET_CAPACITY", lambda: _optional_positive(self.get("FLEET_CAPACITY"), "FLEET_CAPACITY"))

    @property
    def worker_capacity(self) -> int | None:
        return self._cached(
            "WORKER_CAPACITY", lambda: _optional_positive(self.get("WORKER_CAPACITY"), "WORKER_CAPACITY")
        )

    @property
    def shed_thresholds(self) -> dict[str, int]:
        return self._cached("SHED_THRESHOLDS", self._parse_thresholds)

    def _parse_thresholds(self) -> dict[str, int]:
        raw = self.get("SHED_THRESHOLDS")
        field = "RATELIMITS['SHED_THRESHOLDS']"
        if not isinstance(raw, dict) or set(raw) - {"low", "normal", "high"}:
            raise ConfigurationError(f"{field} must be a dict with keys low, normal and high (critical is never shed)")
        thresholds = {}
        for klass in ("low", "normal", "high"):
            value = raw.get(klass, 100)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
                raise ConfigurationError(f"{field}['{klass}']: {value!r} must be a percentage from 1 to 100")
            thresholds[klass] = value
        if not thresholds["low"] <= thresholds["normal"] <= thresholds["high"]:
            raise ConfigurationError(f"{field}: thresholds must rise with priority (low <= normal <= high)")
        return thresholds

    @property
    def usage_counting(self) -> bool:
        return self._cached("USAGE", lambda: bool(self.get("USAGE")))

    @property
    def policy_source(self) -> str:
        return str(self.get("POLICY_SOURCE"))

    @property
    def tier_func(self) -> Callable[..., str | None] | None:
        return self._cached("TIER_FUNC", lambda: _callable_or_none(self.get("TIER_FUNC"), "TIER_FUNC"))

    @property
    def api_key_func(self) -> Callable[[Any], str | None]:
        return self._cached("API_KEY_FUNC", lambda: _callable(self.get("API_KEY_FUNC"), "API_KEY_FUNC"))

    @property
    def organization_func(self) -> Callable[[Any], str | None]:
        return self._cached("ORGANIZATION_FUNC", lambda: _callable(self.get("ORGANIZATION_FUNC"), "ORGANIZATION_FUNC"))

    @property
    def trusted_proxies(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        return self._cached("TRUSTED_PROXIES", self._parse_proxies)

    def _parse_proxies(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        raw = self.get("TRUSTED_PROXIES")
        if isinstance(raw, str) or not isinstance(raw, (list, tuple)):
            raise ConfigurationError("RATELIMITS['TRUSTED_PROXIES'] must be a list of addresses or networks")
        networks = []
        for item in raw:
            try:
                networks.append(ipaddress.ip_network(str(item), strict=False))
            except ValueError:
                raise ConfigurationError(
                    f"RATELIMITS['TRUSTED_PROXIES']: {item!r} is not an IP address or network"
                ) from None
        return tuple(networks)

    @property
    def client_ip_header(self) -> str:
        return str(self.get("CLIENT_IP_HEADER"))

    @property
    def ipv6_prefix(self) -> int:
        return self._cached("IPV6_PREFIX", self._parse_ipv6_prefix)

    def _parse_ipv6_prefix(self) -> int:
        prefix = self.get("IPV6_PREFIX")
        if not isinstance(prefix, int) or isinstance(prefix, bool) or not 1 <= prefix <= 128:
            raise ConfigurationError(f"RATELIMITS['IPV6_PREFIX']: {prefix!r} must be an integer from 1 to 128")
        return prefix

    @property
    def hash_key(self) -> bytes:
        def build() -> bytes:
            secret = self.get("HASH_KEY") or settings.SECRET_KEY
            return hashlib.blake2b(str(secret).encode(), digest_size=32, person=b"ratelimits").digest()

        return self._cached("HASH_KEY", build)

    @property
    def headers(self) -> str:
        return self._cached("HEADERS", self._parse_headers)

    def _parse_headers(self) -> str:
        style = self.get("HEADERS")
        if style not in HEADER_STYLES:
            raise ConfigurationError(f"RATELIMITS['HEADERS']: {style!r} must be one of {', '.join(HEADER_STYLES)}")
        return str(style)

    @property
    def retry_after_jitter_us(self) -> int:
        return self._cached("RETRY_AFTER_JITTER", self._parse_jitter)

    def _parse_jitter(self) -> int:
        value = self.get("RETRY_AFTER_JITTER")
        if value in ("0", "0ms", "0s", 0):
            return 0
        return parse_duration(value, field="RATELIMITS['RETRY_AFTER_JITTER']")

    @property
    def default_fail_mode(self) -> str:
        return fail_mode(self.get("DEFAULT_FAIL_MODE"), field="RATELIMITS['DEFAULT_FAIL_MODE']")

    @property
    def local_fallback_share(self) -> float:
        share = self.get("LOCAL_FALLBACK_SHARE")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ConfigurationError(f"RATELIMITS['LOCAL_FALLBACK_SHARE']: {share!r} must be a number in (0, 1]")
        return float(share)

    @property
    def breaker(self) -> dict[str, Any]:
        window = self.get("BREAKER_WINDOW")
        min_calls = self.get("BREAKER_MIN_CALLS")
        rate = self.get("BREAKER_FAILURE_RATE")
        for name, value in (("BREAKER_WINDOW", window), ("BREAKER_MIN_CALLS", min_calls)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"RATELIMITS['{name}']: {value!r} must be a positive integer")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ConfigurationError(f"RATELIMITS['BREAKER_FAILURE_RATE']: {rate!r} must be a number in (0, 1]")
        return {
            "window": window,
            "min_calls": min(min_calls, window),
            "failure_rate": float(rate),
            "cooldown": _seconds(self.get("BREAKER_COOLDOWN"), "BREAKER_COOLDOWN"),
        }


def fail_mode(value: object, *, field: str) -> str:
    """Validate a fail mode name."""
    if value not in FAIL_MODES:
        raise ConfigurationError(f"{field}: {value!r} must be one of {', '.join(FAIL_MODES)}")
    return str(value)


def _seconds(value: object, name: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return parse_duration(value, field=f"RATELIMITS['{name}']") / 1_000_000


def _optional_positive(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"RATELIMITS['{name}']: {value!r} must be a positive integer or None")
    return value


def _callable(path: object, name: str) -> Callable[..., Any]:
    if callable(path):
        return path
    try:
        return import_string(str(path))  # type: ignore[no-any-return]
    except ImportError as exc:
        raise ConfigurationError(f"RATELIMITS['{name}']: cannot import {path!r}: {exc}") from exc


def _callable_or_none(path: object, name: str) -> Callable[..., Any] | None:
    return None if path is None else _callable(path, name)


conf = Settings()


def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting in ("RATELIMITS", "SECRET_KEY"):
        conf.clear()


setting_changed.connect(_reset)
