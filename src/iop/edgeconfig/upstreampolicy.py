"""The upstream policy: which addresses providers may reach, and where each API key may go.

Whoever may edit an EdgeConfig chooses each provider's `base_url` and `api_key_env`; the policy
is what they cannot change. It is given to a process by whoever runs it (`--upstream-policy`,
or `IOP_UPSTREAM_POLICY`; the chart renders it from `upstreams` and each `apiKeys` entry), and
checked by the operator's webhook and again where a request is made (the Node, or the Edge for
a node placed on it). docs/operator.md, "Who may do what", is the user's account.

- `allow`: what an upstream may be. `name`, `name:port` or `*.suffix[:port]` allow a URL host by
  its name (whatever it resolves to, but an address a range below denies); an address or a CIDR
  allows those addresses; `public` allows every globally routable address.
- `deny`: CIDRs refused, even to a name that `allow` lists. Loopback, link-local (the cloud
  metadata address), unspecified and multicast addresses are denied the same way, built in.
  Between CIDRs (allowed, denied, built in) the most specific that holds an address decides,
  a denial on a tie: `allow: [10.0.0.0/8]` with `deny: [10.96.0.0/12]` refuses the second.
- `keys`: the API keys a config may name, by variable: the hosts (names, addresses, CIDRs)
  each may be sent to, and, when given, the providers that may use it. A variable with no
  binding is never read.

A process given no policy (the CLI's default) reaches any address and reads any variable: the
person who runs it writes its config too.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Final
from urllib.parse import urlsplit

import orjson
import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from .configs import EdgeConfig
from .errors import ConfigError, Problem
from .fields import EnvName, Name, camel_name
from .nodespecs import OpenAIAdapterSettings

#: The `allow` entry for every globally routable address.
PUBLIC: Final = "public"

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Ranges no name and no `public` reaches: only a CIDR of `allow` that holds an address (and is
#: at least as specific) lets it through.
BUILT_IN_DENIED: Final[tuple[IPNetwork, ...]] = tuple(
    ipaddress.ip_network(cidr)
    for cidr in (
        "0.0.0.0/8",  # this network; 0.0.0.0 reaches the host itself
        "127.0.0.0/8",  # loopback: the process's own listeners
        "169.254.0.0/16",  # link-local: the cloud metadata address 169.254.169.254
        "224.0.0.0/4",  # multicast
        "255.255.255.255/32",
        "::/128",
        "::1/128",
        "fe80::/10",
        "ff00::/8",
    )
)

_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOST_ENTRY = re.compile(rf"^(\*\.)?{_LABEL}(\.{_LABEL})*(:(?P<port>[0-9]{{1,5}}))?$")


@dataclass(frozen=True, slots=True)
class _HostName:
    """`name`, `name:port` or `*.suffix[:port]`: a URL host by its name."""

    name: str
    port: int | None
    wildcard: bool

    def matches(self, host: str, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.wildcard:
            return host.endswith("." + self.name)
        return host == self.name


def _parse_entry(entry: str, *, public_allowed: bool) -> _HostName | IPNetwork | str:
    text = entry.strip().lower().rstrip(".")
    if text == PUBLIC and public_allowed:
        return PUBLIC
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        pass
    match = _HOST_ENTRY.match(text)
    if match is None:
        raise ValueError(
            f"{entry!r} is not a host name (name, name:port, *.suffix), an address or a CIDR"
            + (" or 'public'" if public_allowed else "")
        )
    port = match.group("port")
    name = text.rsplit(":", 1)[0] if port else text
    if port is not None and not 1 <= int(port) <= 65535:
        raise ValueError(f"{entry!r}: the port must be 1-65535")
    wildcard = name.startswith("*.")
    return _HostName(name[2:] if wildcard else name, int(port) if port else None, wildcard)


def _check_allow(value: str) -> str:
    _parse_entry(value, public_allowed=True)
    return value


def _check_host(value: str) -> str:
    if value.strip().lower() == PUBLIC:
        raise ValueError("a key is bound to the hosts it is for, never to every public address")
    _parse_entry(value, public_allowed=False)
    return value


def _check_cidr(value: str) -> str:
    try:
        ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise ValueError(f"{value!r} is not an address or a CIDR") from None
    return value


AllowEntry = Annotated[str, AfterValidator(_check_allow)]
HostEntry = Annotated[str, AfterValidator(_check_host)]
CidrEntry = Annotated[str, AfterValidator(_check_cidr)]


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=camel_name, populate_by_name=True
    )


class KeyBinding(_Section):
    """Where the API key in one environment variable may be sent."""

    env: EnvName
    hosts: Annotated[list[HostEntry], Field(min_length=1)]
    providers: list[Name] = Field(default_factory=list)

    @cached_property
    def _hosts(self) -> tuple[_HostName | IPNetwork, ...]:
        parsed = (_parse_entry(h, public_allowed=False) for h in self.hosts)
        return tuple(entry for entry in parsed if not isinstance(entry, str))

    def admits_host(self, host: str, port: int) -> bool:
        address = _address(host)
        for entry in self._hosts:
            if isinstance(entry, _HostName):
                if entry.matches(host, port):
                    return True
            elif address is not None and address.version == entry.version and address in entry:
                return True
        return False


class UpstreamPolicy(_Section):
    """What providers may reach and which keys they may read (the module's docstring)."""

    allow: list[AllowEntry] = Field(default_factory=list)
    deny: list[CidrEntry] = Field(default_factory=list)
    keys: list[KeyBinding] = Field(default_factory=list)

    @cached_property
    def _parsed(self) -> tuple[tuple[_HostName, ...], tuple[IPNetwork, ...], bool]:
        names: list[_HostName] = []
        networks: list[IPNetwork] = []
        public = False
        for entry in self.allow:
            parsed = _parse_entry(entry, public_allowed=True)
            if parsed == PUBLIC:
                public = True
            elif isinstance(parsed, _HostName):
                names.append(parsed)
            elif not isinstance(parsed, str):
                networks.append(parsed)
        return tuple(names), tuple(networks), public

    @cached_property
    def _denied(self) -> tuple[IPNetwork, ...]:
        denied = (ipaddress.ip_network(cidr.strip(), strict=False) for cidr in self.deny)
        return BUILT_IN_DENIED + tuple(denied)

    @property
    def decides_by_address(self) -> bool:
        """Whether a host that no name entry lists may still be allowed by what it resolves
        to (`allow` holds a CIDR or `public`)."""
        _, networks, public = self._parsed
        return public or bool(networks)

    def names_host(self, host: str, port: int) -> bool:
        """Whether a name entry of `allow` lists `host:port` (lowercase, no trailing dot)."""
        names, _, _ = self._parsed
        return any(name.matches(host, port) for name in names)

    def address_problem(self, host: str, port: int, address: IPAddress) -> str | None:
        """Why `host:port`, resolved to `address`, may not be reached; None when it may."""
        address = _unmapped(address)
        names, networks, public = self._parsed
        best: tuple[int, bool] | None = None  # (prefix length, allowed) of the most specific
        rules = [*((n, True) for n in networks), *((n, False) for n in self._denied)]
        for network, allowed in rules:
            if network.version != address.version or address not in network:
                continue
            # Longest prefix first; on a tie a denial (False) sorts first.
            if best is None or (network.prefixlen, not allowed) > (best[0], not best[1]):
                best = (network.prefixlen, allowed)
        shown = host if host == str(address) else f"{host} ({address})"
        if best is not None:
            if best[1]:
                return None
            return f"{shown} is in a range the upstream policy denies"
        if any(name.matches(host, port) for name in names):
            return None
        if public and address.is_global:
            return None
        return f"{shown} is not allowed by the upstream policy"

    def host_problem(self, host: str, port: int) -> str | None:
        """Why `host:port` may not be reached, decided without resolving it: a literal address
        by `address_problem`, a name by the name entries; None when it may be allowed (a name
        that only its addresses can allow is checked again when they are known)."""
        address = _address(host)
        if address is not None:
            return self.address_problem(host, port, address)
        if self.names_host(host, port) or self.decides_by_address:
            return None
        return f"{host}:{port} is not allowed by the upstream policy"

    def key_problem(self, env: str, provider_id: str, host: str, port: int) -> str | None:
        """Why provider `provider_id` (its upstream at `host:port`) may not send the key in
        `env`; None when it may."""
        bindings = [b for b in self.keys if b.env == env]
        if not bindings:
            return f"environment variable {env} is bound to no provider by the upstream policy"
        for binding in bindings:
            if binding.providers and provider_id not in binding.providers:
                continue
            if binding.admits_host(host, port):
                return None
        hosts = sorted({h for b in bindings for h in b.hosts})
        providers = sorted({p for b in bindings for p in b.providers})
        bound = f"hosts {', '.join(hosts)}" + (
            f" and providers {', '.join(providers)}" if providers else ""
        )
        return (
            f"the key in {env} may go only to {bound} (the upstream policy), not to provider "
            f"{provider_id} at {host}:{port}"
        )

    def url_problems(
        self, provider_id: str, settings: OpenAIAdapterSettings
    ) -> Iterator[tuple[str, str]]:
        """(field, why) for each of an `openai` adapter's settings this policy refuses."""
        host, port = url_host_port(settings.base_url)
        problem = self.host_problem(host, port)
        if problem is not None:
            yield "base_url", problem
        if settings.api_key_env is not None:
            problem = self.key_problem(settings.api_key_env, provider_id, host, port)
            if problem is not None:
                yield "api_key_env", problem

    def config_problems(self, config: EdgeConfig, *, camel: bool = True) -> list[Problem]:
        """Every provider setting of `config` this policy refuses, with its path in the CRD's
        spelling (the operator's), or edge.yaml's (`camel=False`)."""
        problems = []
        for n, node in enumerate(config.nodes):
            for p, provider in enumerate(node.providers):
                if not isinstance(provider.adapter, OpenAIAdapterSettings):
                    continue
                for key, problem in self.url_problems(provider.id, provider.adapter):
                    field = camel_name(key) if camel else key
                    path = f"nodes[{n}].providers[{p}].adapter.{field}"
                    problems.append(Problem(path, problem))
        return problems

    def unlisted_names(self, config: EdgeConfig) -> list[Problem]:
        """The providers whose URL host is a name no entry lists, which only the addresses it
        resolves to can allow (`decides_by_address`): what the webhook cannot judge, and says so
        (paths in the CRD's spelling)."""
        if not self.decides_by_address:
            return []
        notes = []
        for n, node in enumerate(config.nodes):
            for p, provider in enumerate(node.providers):
                if not isinstance(provider.adapter, OpenAIAdapterSettings):
                    continue
                host, port = url_host_port(provider.adapter.base_url)
                if _address(host) is None and not self.names_host(host, port):
                    notes.append(
                        Problem(
                            f"nodes[{n}].providers[{p}].adapter.baseUrl",
                            f"{host} is listed by no name of the upstream policy: it is reached "
                            "only where it resolves to an address the policy allows (checked on "
                            "every connection)",
                        )
                    )
        return notes

    def require_allowed(self, config: EdgeConfig, *, camel: bool = True) -> None:
        """Raise a `ConfigError` with `config_problems(config)`, if there is any."""
        problems = self.config_problems(config, camel=camel)
        if problems:
            raise ConfigError(problems)


def url_host_port(url: str) -> tuple[str, int]:
    """The host (lowercase, no brackets, no trailing dot) and port (the scheme's default when
    none is given) that `url` reaches."""
    parts = urlsplit(url)
    host = (parts.hostname or "").rstrip(".")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return host, port


def parse_policy(text: str, where: str = "the upstream policy") -> UpstreamPolicy:
    """A policy from its JSON or YAML text; a `ConfigError` naming `where` and each problem."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError([Problem(where, f"is neither JSON nor YAML: {exc}")]) from None
    try:
        return UpstreamPolicy.model_validate(data if data is not None else {})
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_url=False):
            path = "".join(
                f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
            ).lstrip(".")
            message = str(error["msg"]).removeprefix("Value error, ")
            problems.append(Problem(f"{where}: {path}" if path else where, message))
        raise ConfigError(problems) from None


def _address(host: str) -> IPAddress | None:
    try:
        return _unmapped(ipaddress.ip_address(host))
    except ValueError:
        return None


def _unmapped(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address as the IPv4 address it reaches."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
