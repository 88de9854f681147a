"""Who is asking: tenants, their API keys, their tier and their limits, read from a tenants file.

A server that several customers share must know which one sent a request from something the client cannot
forge: the API key. Everything a client writes in the body (`user`, `session_id`, `priority`, `service_tier`) is
a name or a wish *inside* the tenant the key belongs to, never an identity. So the key is looked up here, once,
in constant time (every configured key digest is compared, `hmac.compare_digest`, whatever matches), and the
request carries the resulting `Caller` from then on: the gateway stamps it on fleet requests and workers trust
only that stamp.

The file (TOML, or JSON of the same shape):

    [[tiers]]                       # optional, highest first; default: priority > standard > free
    name = "gold"
    service_tier = "priority"       # what OpenAI's `service_tier` calls it: priority, default or flex

    [tenants.acme]
    keys = ["key-tenant-a"]         # and/or key_sha256 = ["<64 hex digits>"]
    tier = "gold"
    requests_per_minute = 600       # optional limits: tokens_per_minute, max_concurrent, max_tokens
    session_ttl = 3600              # optional: seconds an idle session's stored KV is kept
    weight = 2                      # optional: its share of its tier's tokens against its peers' (default 1)
    max_sessions = 10000            # optional: sessions whose stored KV is indexed; the least recently used go

    [shared_prefixes.support]       # optional: prefix-cache sharing across tenants, only of this text
    text = "You are the support assistant of ..."
    tenants = ["acme", "globex"]

Every problem in a file is reported at once, each with its line. `Tenants` is immutable: a reload (SIGHUP)
builds a new one and swaps it in (`TenantsSource`), so a request in flight keeps the tenant it was admitted as.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantize.common.errors import QpackError
from serve.offload.sessions import DEFAULT_MAX_SESSIONS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

SERVICE_TIERS = ("priority", "default", "flex")  # what a tier answers as in OpenAI's `service_tier`
REQUESTED_SERVICE_TIERS = ("auto", *SERVICE_TIERS)
DEFAULT_TENANT = "default"  # the tenant of `--api-key` keys, and of every request on a server without keys
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # tenant and tier names: metric labels, Redis keys
HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Tier:
    """A service tier: `rank` 0 is the highest; `service_tier` is its OpenAI name. Its promise, when the file
    makes one: a first token within `ttft_ms` and the next ones every `tpot_ms` (per request), answered by a
    variant no further from the reference model than `max_kl` (the measured next-token KL in its manifest)."""

    name: str
    rank: int
    service_tier: str
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    max_kl: float | None = None


BUILTIN_TIERS = (Tier("priority", 0, "priority"), Tier("standard", 1, "default"), Tier("free", 2, "flex"))


@dataclass(frozen=True)
class Limits:
    """What one tenant may use; None: unlimited."""

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = (
        None  # prompt + max_tokens reserved at admission, the unused part returned
    )
    max_concurrent: int | None = None  # requests in flight at once
    max_tokens: int | None = (
        None  # the largest `max_tokens` a request may ask (and the default when it asks none)
    )

    @property
    def any(self) -> bool:
        return any(
            v is not None for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent)
        )


@dataclass(frozen=True)
class SharedPrefix:
    """A text that the tenants named with it may share prefix-cache blocks of: a chat whose first message is a
    system message of exactly this text, or a completion prompt that starts with it. Carried by digest: the
    text itself stays in the file."""

    name: str
    sha256: str  # of the text, UTF-8
    chars: int

    def matches(self, text: str) -> bool:
        """Whether `text` starts with this prefix (compared by digest: the shared text never travels)."""
        head = text[: self.chars]
        return len(head) == self.chars and hmac.compare_digest(
            hashlib.sha256(head.encode()).hexdigest(), self.sha256
        )


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: Tier
    limits: Limits = Limits()
    key_digests: tuple[bytes, ...] = ()
    session_ttl: float | None = None
    shared_prefixes: tuple[SharedPrefix, ...] = ()
    weight: float = 1.0
    max_sessions: int = DEFAULT_MAX_SESSIONS  # sessions of stored KV indexed at once, per engine

    def __repr__(self) -> str:  # never print a key digest
        return f"Tenant({self.name!r}, tier={self.tier.name!r}, keys=<{len(self.key_digests)}>)"


@dataclass(frozen=True)
class Caller:
    """A request's identity as the server resolved it from its key, with the tier it runs at (its tenant's, or a
    lower one it asked for with `service_tier`): what the engine, the tiers and a fleet worker act on. Plain
    JSON for the fleet's stamp; no key material."""

    tenant: str = DEFAULT_TENANT
    tier: str = "standard"
    tier_rank: int = 1
    service_tier: str = "default"
    tokens_per_minute: float | None = None
    max_tokens: int | None = None
    session_ttl: float | None = None
    shared_prefixes: tuple[SharedPrefix, ...] = ()
    weight: float = 1.0
    max_sessions: int = DEFAULT_MAX_SESSIONS

    def to_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "tier": self.tier,
            "tier_rank": self.tier_rank,
            "service_tier": self.service_tier,
            "tokens_per_minute": self.tokens_per_minute,
            "max_tokens": self.max_tokens,
            "session_ttl": self.session_ttl,
            "shared_prefixes": [[p.name, p.sha256, p.chars] for p in self.shared_prefixes],
            "weight": self.weight,
            "max_sessions": self.max_sessions,
        }

    @classmethod
    def from_json(cls, data: Any) -> Caller:
        """The stamp a gateway wrote; ValueError when it is not one."""
        if not isinstance(data, dict):
            raise ValueError("the caller stamp must be an object")
        try:
            prefixes = tuple(
                SharedPrefix(str(n), str(d), int(c)) for n, d, c in data.get("shared_prefixes", [])
            )
            caller = cls(
                tenant=str(data["tenant"]),
                tier=str(data["tier"]),
                tier_rank=int(data["tier_rank"]),
                service_tier=str(data["service_tier"]),
                tokens_per_minute=_optional(data.get("tokens_per_minute"), float),
                max_tokens=_optional(data.get("max_tokens"), int),
                session_ttl=_optional(data.get("session_ttl"), float),
                shared_prefixes=prefixes,
                weight=float(data.get("weight", 1.0)),
                max_sessions=max(1, int(data.get("max_sessions") or DEFAULT_MAX_SESSIONS)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"the caller stamp is incomplete ({exc})") from None
        if not NAME.match(caller.tenant):
            raise ValueError(f"the caller stamp names no valid tenant ({caller.tenant!r})")
        if not 0 < caller.weight < float("inf"):
            raise ValueError(f"the caller stamp's weight must be positive (got {caller.weight!r})")
        return caller


def _optional(value: Any, kind: type) -> Any:
    return None if value is None else kind(value)


def key_digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


@dataclass(frozen=True)
class Tenants:
    """The tenants a server knows. Without any (`open`), every request is the default tenant, standard tier."""

    tiers: tuple[Tier, ...] = BUILTIN_TIERS
    tenants: tuple[Tenant, ...] = ()
    source: str = "no tenants"
    _by_digest: tuple[tuple[bytes, Tenant], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        pairs = tuple((digest, tenant) for tenant in self.tenants for digest in tenant.key_digests)
        object.__setattr__(self, "_by_digest", pairs)

    @property
    def open(self) -> bool:
        """No keys configured: nobody is asked for one."""
        return not self._by_digest

    def tenant(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)

    def authenticate(self, key: bytes | None) -> Tenant | None:
        """The tenant whose key this is, or None. Constant time in the key's content: the presented key's digest
        is compared with every configured digest, all of them, whichever matches."""
        if self.open:
            return ANONYMOUS
        digest = key_digest(key or b"")
        found: Tenant | None = None
        for candidate, tenant in self._by_digest:
            if hmac.compare_digest(digest, candidate):
                found = tenant
        return found if key else None

    def caller(self, tenant: Tenant, requested: str | None) -> Caller:
        """The tenant at the tier this request runs at. `requested` (OpenAI's `service_tier`) may lower it, never
        raise it: a request asking for a tier above its tenant's runs at its tenant's tier, and the response's
        `service_tier` says so (OpenAI answers with the tier actually used, which may differ from the one asked)."""
        tier = tenant.tier
        if requested not in (None, "auto"):
            lower = [t for t in self.tiers if t.service_tier == requested and t.rank >= tenant.tier.rank]
            if lower:
                tier = min(lower, key=lambda t: t.rank)
        return Caller(
            tenant=tenant.name,
            tier=tier.name,
            tier_rank=tier.rank,
            service_tier=tier.service_tier,
            tokens_per_minute=tenant.limits.tokens_per_minute,
            max_tokens=tenant.limits.max_tokens,
            session_ttl=tenant.session_ttl,
            shared_prefixes=tenant.shared_prefixes,
            weight=tenant.weight,
            max_sessions=tenant.max_sessions,
        )

    @classmethod
    def with_keys(cls, keys: Iterable[str], tiers: tuple[Tier, ...] = BUILTIN_TIERS) -> Tenants:
        """`--api-key` keys: one tenant, `default`, at the standard tier, no limits."""
        digests = tuple(dict.fromkeys(key_digest(k) for k in keys))
        if not digests:
            return cls(tiers)
        return cls(tiers, (Tenant(DEFAULT_TENANT, _default_tier(tiers), key_digests=digests),), "--api-key")


ANONYMOUS = Tenant(DEFAULT_TENANT, BUILTIN_TIERS[1])


def _default_tier(tiers: tuple[Tier, ...]) -> Tier:
    """The tier of `--api-key` keys: the one OpenAI would call `default`, else the lowest."""
    return next((t for t in tiers if t.service_tier == "default"), tiers[-1])


class TenantsError(QpackError):
    """A tenants file that cannot be used; the message names every problem with its line."""


def load_tenants(path: Path, api_keys: Iterable[str] = ()) -> Tenants:
    """The tenants of the file at `path` (TOML; JSON or YAML by a `.json`, `.yaml` or `.yml` suffix), with
    `--api-key` keys as the `default` tenant; TenantsError naming every problem at once, each with its line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsError(f"tenants file {path} cannot be read ({exc}); fix `tenants_file`") from None
    file_format = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}.get(path.suffix.lower(), "toml")
    return parse_tenants(text, str(path), file_format, api_keys=api_keys)


def parse_tenants(text: str, source: str, file_format: str = "toml", api_keys: Iterable[str] = ()) -> Tenants:
    data = _decode(text, source, file_format)
    problems = _Problems(text)
    tiers = _tiers(data.get("tiers"), problems)
    prefixes = _shared_prefixes(data.get("shared_prefixes"), problems)
    tenants = _tenants(data.get("tenants"), tiers, prefixes, problems)
    for key in sorted(set(data) - {"tiers", "tenants", "shared_prefixes"}):
        problems.add((key,), "is not a known section (tiers, tenants, shared_prefixes)")
    raw_tenants = data.get("tenants")
    defined = set(raw_tenants) if isinstance(raw_tenants, dict) else set()
    for name, (_prefix, members) in prefixes.items():
        for member in members:
            if member not in defined:
                problems.add(
                    ("shared_prefixes", name, "tenants"), f"names tenant {member!r}, which is not defined"
                )
    keyed = Tenants.with_keys(api_keys, tiers)
    if keyed.tenants:
        if any(t.name == DEFAULT_TENANT for t in tenants):
            problems.add(
                ("tenants", DEFAULT_TENANT), "is the tenant of `--api-key` keys; rename it or drop those"
            )
        tenants.append(keyed.tenants[0])
    _check_keys_unique(tenants, problems)
    if not tenants and not problems.found:
        problems.add(("tenants",), "defines no tenant; add [tenants.NAME] with keys = [...]")
    if problems.found:
        raise TenantsError(f"tenants file {source}: " + "; ".join(problems.found) + "; fix the file")
    return Tenants(tiers, tuple(tenants), source)


def _decode(text: str, source: str, file_format: str) -> dict[str, Any]:
    if file_format == "yaml":
        return _decode_yaml(text, source)
    try:
        data = json.loads(text) if file_format == "json" else tomllib.loads(text)
    except json.JSONDecodeError as exc:
        raise TenantsError(f"tenants file {source}: line {exc.lineno}: {exc.msg}; fix the JSON") from None
    except tomllib.TOMLDecodeError as exc:
        where = f"at line {max(1, len(text.splitlines()))}, the end of the file"
        message = str(exc).replace("at end of document", where)
        raise TenantsError(f"tenants file {source}: {message}; fix the TOML") from None
    if not isinstance(data, dict):
        raise TenantsError(f"tenants file {source}: line 1: must hold an object of sections; fix the file")
    return data


def _decode_yaml(text: str, source: str) -> dict[str, Any]:
    """YAML's safe subset (plain data, no tags that build objects); every mapping key must be a string."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise TenantsError(
            f"tenants file {source}: line {line}: {exc.problem or exc}; fix the YAML"
        ) from None
    except yaml.YAMLError as exc:
        raise TenantsError(f"tenants file {source}: {exc}; fix the YAML") from None
    if not isinstance(data, dict):
        raise TenantsError(f"tenants file {source}: line 1: must hold a mapping of sections; fix the file")
    strange = sorted(_non_string_keys(data, ()))
    if strange:
        raise TenantsError(
            f"tenants file {source}: keys must be strings, not {', '.join(strange)}; quote them in the YAML"
        )
    return data


def _non_string_keys(value: Any, path: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                found.append(".".join((*path, repr(key))))
            found += _non_string_keys(item, (*path, str(key)))
    elif isinstance(value, list):
        for item in value:
            found += _non_string_keys(item, path)
    return found


class _Problems:
    """Problems of one file, each prefixed with the line of the setting it is about (best effort: the first line
    that names each part of its path in order, as a TOML key, table header, JSON or YAML key)."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.found: list[str] = []

    def line(self, path: tuple[str, ...]) -> int:
        at = 0
        for part in path:
            word = re.escape(part)
            pattern = re.compile(rf"""(^|[\s\[.{{,])["']?{word}["']?\s*([=:\].]|$)""")
            for index in range(at, len(self.lines)):
                if pattern.search(self.lines[index].split("#", 1)[0]):
                    at = index
                    break
        return at + 1

    def add(self, path: tuple[str, ...], message: str) -> None:
        self.found.append(f"line {self.line(path)}: {'.'.join(path)} {message}")


def _tiers(raw: Any, problems: _Problems) -> tuple[Tier, ...]:
    if raw is None:
        return BUILTIN_TIERS
    if not isinstance(raw, list) or not raw or not all(isinstance(t, dict) for t in raw):
        problems.add(("tiers",), "must be a list of tables ([[tiers]], highest first) with `name`")
        return BUILTIN_TIERS
    tiers: list[Tier] = []
    for entry in raw:
        name = entry.get("name")
        where = ("tiers", str(name))
        if not isinstance(name, str) or not NAME.match(name):
            problems.add(("tiers", "name"), f"must be a name of letters, digits, _ . - (got {name!r})")
            continue
        if any(t.name == name for t in tiers):
            problems.add(where, "is defined twice")
        service = entry.get("service_tier", "default")
        if service not in SERVICE_TIERS:
            problems.add(
                (*where, "service_tier"), f"must be one of {', '.join(SERVICE_TIERS)} (got {service!r})"
            )
        for key in sorted(set(entry) - {"name", "service_tier", *_PROMISES}):
            problems.add((*where, key), f"is not a tier setting (name, service_tier, {', '.join(_PROMISES)})")
        promises = {key: _positive(entry.get(key), (*where, key), problems) for key in _PROMISES}
        tiers.append(Tier(name, len(tiers), str(service), **promises))
    return tuple(tiers) or BUILTIN_TIERS


_PROMISES = ("ttft_ms", "tpot_ms", "max_kl")


def _positive(value: Any, where: tuple[str, ...], problems: _Problems) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        problems.add(where, f"must be a number >= 0 (got {value!r})")
        return None
    return float(value)


_PrefixEntry = tuple[SharedPrefix, tuple[str, ...]]


def _shared_prefixes(raw: Any, problems: _Problems) -> dict[str, _PrefixEntry]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.add(("shared_prefixes",), "must be a table of [shared_prefixes.NAME] with text and tenants")
        return {}
    found: dict[str, _PrefixEntry] = {}
    for name, entry in raw.items():
        where = ("shared_prefixes", name)
        if not NAME.match(name) or not isinstance(entry, dict):
            problems.add(where, "must be a [shared_prefixes.NAME] table (NAME: letters, digits, _ . -)")
            continue
        text, members = entry.get("text"), entry.get("tenants")
        if not isinstance(text, str) or not text:
            problems.add((*where, "text"), "must be a non-empty string")
            continue
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members) or len(members) < 2:
            problems.add((*where, "tenants"), "must list the (two or more) tenants that share this text")
            continue
        for key in sorted(set(entry) - {"text", "tenants"}):
            problems.add((*where, key), "is not a shared-prefix setting (text, tenants)")
        prefix = SharedPrefix(name, hashlib.sha256(text.encode()).hexdigest(), len(text))
        found[name] = (prefix, tuple(members))
    return found


_LIMITS = {
    "requests_per_minute": float,
    "tokens_per_minute": float,
    "max_concurrent": int,
    "max_tokens": int,
    "session_ttl": float,
    "weight": float,
    "max_sessions": int,
}


def _tenants(
    raw: Any, tiers: tuple[Tier, ...], prefixes: dict[str, _PrefixEntry], problems: _Problems
) -> list[Tenant]:
    if raw is None:
        return []
    if not isinstance(raw, dict):
        problems.add(("tenants",), "must be a table of [tenants.NAME] tables")
        return []
    tenants = []
    for name, entry in raw.items():
        where = ("tenants", name)
        if not NAME.match(name) or not isinstance(entry, dict):
            problems.add(where, "must be a [tenants.NAME] table (NAME: letters, digits, _ . -, at most 64)")
            continue
        tenant = _tenant(name, entry, tiers, prefixes, problems)
        if tenant is not None:
            tenants.append(tenant)
    return tenants


def _tenant(
    name: str,
    entry: dict[str, Any],
    tiers: tuple[Tier, ...],
    prefixes: dict[str, _PrefixEntry],
    problems: _Problems,
) -> Tenant | None:
    where = ("tenants", name)
    before = len(problems.found)
    known = {"keys", "key_sha256", "tier", *_LIMITS}
    for key in sorted(set(entry) - known):
        problems.add((*where, key), f"is not a tenant setting ({', '.join(sorted(known))})")
    digests = _digests(entry, where, problems)
    tier_name = entry.get("tier", _default_tier(tiers).name)
    tier = next((t for t in tiers if t.name == tier_name), None)
    if tier is None:
        problems.add(
            (*where, "tier"), f"must be one of {', '.join(t.name for t in tiers)} (got {tier_name!r})"
        )
    values: dict[str, Any] = {}
    for key, kind in _LIMITS.items():
        value = entry.get(key)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (kind is int and not isinstance(value, int))
        ):
            problems.add(
                (*where, key), f"must be {'an integer' if kind is int else 'a number'} (got {value!r})"
            )
        elif value <= 0:
            problems.add((*where, key), f"must be positive (got {value})")
        else:
            values[key] = kind(value)
    if len(problems.found) > before or tier is None:
        return None
    shared = tuple(prefix for prefix, members in prefixes.values() if name in members)
    session_ttl = values.pop("session_ttl", None)
    weight = values.pop("weight", 1.0)
    max_sessions = values.pop("max_sessions", DEFAULT_MAX_SESSIONS)
    return Tenant(name, tier, Limits(**values), digests, session_ttl, shared, weight, max_sessions)


def _digests(entry: dict[str, Any], where: tuple[str, ...], problems: _Problems) -> tuple[bytes, ...]:
    keys, hashed = entry.get("keys", []), entry.get("key_sha256", [])
    digests: list[bytes] = []
    if not isinstance(keys, list) or not all(isinstance(k, str) and k and k.strip() == k for k in keys):
        problems.add((*where, "keys"), "must be a list of API keys (non-empty strings without spaces around)")
    else:
        digests += [key_digest(k) for k in keys]
    if not isinstance(hashed, list) or not all(
        isinstance(h, str) and HEX_DIGEST.match(h.lower()) for h in hashed
    ):
        problems.add((*where, "key_sha256"), "must be a list of sha256 digests (64 hex digits) of API keys")
    else:
        digests += [bytes.fromhex(h) for h in hashed]
    if not digests and isinstance(keys, list) and isinstance(hashed, list):
        problems.add(where, "has no key; give it keys = [...] or key_sha256 = [...]")
    return tuple(dict.fromkeys(digests))


def _check_keys_unique(tenants: list[Tenant], problems: _Problems) -> None:
    owners: dict[bytes, str] = {}
    for tenant in tenants:
        for digest in tenant.key_digests:
            other = owners.setdefault(digest, tenant.name)
            if other != tenant.name:
                problems.add(("tenants", tenant.name, "keys"), f"holds a key tenant {other!r} holds too")


class TenantsSource:
    """The tenants in force: from a file (reloaded on demand, e.g. on SIGHUP) or from `--api-key` keys alone.
    A reload that fails leaves the tenants in force as they were, and says why."""

    def __init__(self, path: Path | None = None, api_keys: Iterable[str] = ()) -> None:
        self.path, self.api_keys = path, tuple(api_keys)
        self._lock = threading.Lock()
        self.reloads = {"ok": 0, "failed": 0}
        self.current = (
            load_tenants(path, self.api_keys) if path is not None else Tenants.with_keys(self.api_keys)
        )

    def __repr__(self) -> str:  # never print a key
        return f"TenantsSource({self.path}, {len(self.current.tenants)} tenants)"

    def reload(self) -> tuple[bool, str]:
        """Read the file again: whether it was taken, and the outcome as one log line (the tenants in force stay
        as they were when the file cannot be used)."""
        if self.path is None:
            return False, "no tenants file to reload (`tenants_file`)"
        with self._lock:
            try:
                fresh = load_tenants(self.path, self.api_keys)
            except TenantsError as exc:
                self.reloads["failed"] += 1
                return False, f"tenants not reloaded (the {len(self.current.tenants)} in force stay): {exc}"
            self.current = fresh
            self.reloads["ok"] += 1
        return (
            True,
            f"tenants reloaded from {self.path}: {len(fresh.tenants)} tenants, {len(fresh.tiers)} tiers",
        )

    def reload_on_sighup(self, log: Callable[[str], None], counted: Callable[[bool], None]) -> None:
        """SIGHUP reads the file again (main thread only); requests in flight keep the tenant they were admitted
        as, and a file that cannot be used leaves the tenants in force, said in the log."""
        if self.path is None:
            return

        def reload(_signum: int, _frame: object) -> None:
            ok, message = self.reload()
            counted(ok)
            log(message)

        signal.signal(signal.SIGHUP, reload)
