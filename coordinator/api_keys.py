"""Who may call the public APIs, and how much each caller may run at once.

Off unless keys are configured. Then every Generate / GenerateStream call (gRPC metadata
``authorization: Bearer <key>``) and every ``/v1/*`` HTTP request (OpenAI's ``Authorization:
Bearer <key>`` header, what the ``openai`` client sends) must carry one of them; health checks and
``/metrics`` stay open for probes and scrapers. Keys come from:

- ``SPECDEC_API_KEY_FILE`` (``--api-key-file``): one key per line, ``KEY [NAME [MAX_CONCURRENT]]``;
  blank lines and ``#`` comments skipped. What deploy/ mounts from a Secret.
- ``SPECDEC_API_KEY`` (``--api-key``, which sets it): one more key, named ``default``.

Each key has a limit of requests in flight at this front (a key's own line, else
``--max-concurrent-per-key``); past it the call is RESOURCE_EXHAUSTED (HTTP 429). A key is also its
caller's *tenant*: the prefix cache of one tenant is never visible to another (docs/http-api.md,
"What is shared"); a request with neither a key nor a ``cache_salt`` is told none of its cache
hits unless the operator opts in (``--report-unscoped-cached-tokens``); and what one tenant's
logged requests hold of the session log is bounded (``--max-output-bytes-per-key``,
coordinator.output_log).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import ResourceExhaustedError, UnauthenticatedError

API_KEY_ENV, API_KEY_FILE_ENV = "SPECDEC_API_KEY", "SPECDEC_API_KEY_FILE"
DEFAULT_MAX_CONCURRENT_PER_KEY = 32
MAX_KEYS = 10_000
MIN_KEY_CHARS = 16  # a key anyone could guess is refused at start


@dataclass(frozen=True)
class ApiKey:
    name: str  # how logs name its caller (never the key itself)
    secret: str
    max_concurrent: int

    @property
    def tenant(self) -> str:
        """A stable id of the key that reveals nothing of it (the prefix cache's scope)."""
        return hashlib.blake2b(self.secret.encode(), digest_size=12, person=b"specdec-tenant").hexdigest()


def parse_key_lines(text: str, default_max_concurrent: int, source: str) -> list[ApiKey]:
    """``KEY [NAME [MAX_CONCURRENT]]`` per line; a bad line is a ValueError naming it."""
    keys = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 3:
            raise ValueError(f"{source} line {number}: KEY [NAME [MAX_CONCURRENT]], got {len(parts)} fields")
        secret = parts[0]
        name = parts[1] if len(parts) > 1 else f"key{number}"
        try:
            limit = int(parts[2]) if len(parts) > 2 else default_max_concurrent
        except ValueError:
            raise ValueError(f"{source} line {number}: MAX_CONCURRENT must be an integer") from None
        keys.append(make_key(name, secret, limit, f"{source} line {number}"))
    return keys


def make_key(name: str, secret: str, max_concurrent: int, source: str) -> ApiKey:
    if len(secret) < MIN_KEY_CHARS or not secret.isprintable() or " " in secret:
        raise ValueError(f"{source}: a key must be at least {MIN_KEY_CHARS} printable characters without spaces")
    if max_concurrent < 1:
        raise ValueError(f"{source}: MAX_CONCURRENT must be >= 1, got {max_concurrent}")
    return ApiKey(name, secret, max_concurrent)


class ApiKeys:
    """The configured keys (none: the APIs are open) and each key's calls in flight."""

    def __init__(self, keys: list[ApiKey]):
        if len(keys) > MAX_KEYS:
            raise ValueError(f"at most {MAX_KEYS} API keys, got {len(keys)}")
        if len({k.secret for k in keys}) != len(keys):
            raise ValueError("an API key is listed twice")
        self.keys = list(keys)
        self.in_flight: dict[str, int] = {k.secret: 0 for k in keys}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key an ``Authorization`` value carries (None when no keys are configured);
        UnauthenticatedError when keys are configured and it carries none of them."""
        if not self.keys:
            return None
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise UnauthenticatedError("an API key is required: send 'Authorization: Bearer <key>'")
        given_bytes = given.strip().encode()
        found = None
        for key in self.keys:  # every key compared, in constant time each: no timing of which matched
            if hmac.compare_digest(given_bytes, key.secret.encode()):
                found = key
        if found is None:
            raise UnauthenticatedError("the API key is not valid")
        return found

    @contextlib.contextmanager
    def slot(self, key: ApiKey | None, calls: int = 1) -> Iterator[None]:
        """``calls`` requests in flight for ``key`` (an HTTP request's choices count one each),
        refused whole past its limit."""
        if key is None:
            yield
            return
        if self.in_flight[key.secret] + calls > key.max_concurrent:
            raise ResourceExhaustedError(
                f"API key {key.name!r} has {self.in_flight[key.secret]} requests in flight, its limit is "
                f"{key.max_concurrent}"
            )
        self.in_flight[key.secret] += calls
        try:
            yield
        finally:
            self.in_flight[key.secret] -= calls


def scoped_salt(key: ApiKey | None, cache_salt: str) -> str:
    """The prefix cache's scope of a request: its own ``cache_salt`` within its key's tenant (one
    fixed-length value, so every tenant gets the same room for its salts)."""
    if key is None:
        return cache_salt
    return hashlib.blake2b(f"{key.tenant}\0{cache_salt}".encode(), digest_size=16).hexdigest()


def has_own_scope(key: ApiKey | None, cache_salt: str) -> bool:
    """Whether a request's prefix-cache scope is its own -- its key's tenant, or its
    ``cache_salt`` -- rather than the one every request without either shares: only then may it
    be told its prefix-cache hits, which otherwise show what other clients sent."""
    return key is not None or bool(cache_salt)


def from_env(env: Mapping[str, str] | None = None, default_max_concurrent: int = DEFAULT_MAX_CONCURRENT_PER_KEY):
    """The keys the environment configures (see the module doc); ValueError naming the variable."""
    env = os.environ if env is None else env
    keys: list[ApiKey] = []
    path = env.get(API_KEY_FILE_ENV, "")
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"{API_KEY_FILE_ENV}: cannot read {path!r}: {exc}") from None
        keys = parse_key_lines(text, default_max_concurrent, API_KEY_FILE_ENV)
        if not keys:
            raise ValueError(f"{API_KEY_FILE_ENV}: {path!r} holds no key")
    if env.get(API_KEY_ENV):
        keys.append(make_key("default", env[API_KEY_ENV].strip(), default_max_concurrent, API_KEY_ENV))
    return ApiKeys(keys)
