"""Egress policies: what a sandbox may reach, decided per destination by the proxy and resolver.

A policy is ``"none"`` (the default: loopback only, no link at all), ``"internet"`` (any public
destination) or :class:`Network` (an allowlist of host names, ``*.`` wildcards and CIDRs, a
denylist that wins over it, and what to do with everything else). A name is decided by the
name rules before anything resolves it, so a name no rule allows never reaches an upstream
resolver (its labels would be an exfiltration channel); CIDR rules decide IP literals, and a
deny CIDR also refuses the addresses an allowed name resolves to. Whatever the policy, the
addresses in :data:`ALWAYS_BLOCKED` (cloud metadata, loopback, private, link-local, CGNAT, ULA,
multicast) and the proxy host's own addresses are never reachable: the check is made on the
address the proxy itself resolved and connects to, so re-pointing a name (DNS rebinding) does
not help.

Presets name the hosts a package registry needs (``pypi``: pypi.org and files.pythonhosted.org);
an allow or deny entry that is a preset's name stands for its hosts (:meth:`Policy.of`).
``[network.presets]`` in warmbox.toml adds presets or redefines one.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from typing import Literal

from warmbox.errors import InvalidArgument

OnUnknown = Literal["deny", "ask"]
Decision = Literal["allow", "deny"]

ALWAYS_BLOCKED = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "::/128",
        "::1/128",
        "::ffff:0:0/96",
        "64:ff9b::/96",
        "fc00::/7",
        "fe80::/10",
        "ff00::/8",
    )
)

# name -> the hosts a registry's client reaches (its index, its downloads, its redirects)
PRESETS: dict[str, tuple[str, ...]] = {
    "pypi": ("pypi.org", "files.pythonhosted.org"),
    "npm": ("registry.npmjs.org",),
    "yarn": ("registry.yarnpkg.com", "registry.npmjs.org"),
    "github": ("github.com", "codeload.github.com", "objects.githubusercontent.com", "raw.githubusercontent.com"),
    "gitlab": ("gitlab.com",),
    "debian": ("deb.debian.org", "security.debian.org"),
    "crates": ("crates.io", "index.crates.io", "static.crates.io"),
    "go": ("proxy.golang.org", "sum.golang.org"),
    "huggingface": ("huggingface.co", "cdn-lfs.huggingface.co", "cas-bridge.xethub.hf.co"),
    "conda": ("conda.anaconda.org", "repo.anaconda.com"),
}

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


def normalize_host(host: object, what: str = "host") -> str:
    """Lower-case IDNA form of a host name, or the canonical text of an IP literal."""
    if not isinstance(host, str) or not host or len(host) > 253:
        raise InvalidArgument(f"{what} must be a host name or IP address, got {host!r}")
    h = host.strip().rstrip(".").lower()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if "%" in h:  # an IPv6 zone id is free text (it would reach the audit log and the approval queue)
        raise InvalidArgument(f"{what} {host!r} is not a host name or a global IP address (zone ids are refused)")
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        pass
    try:
        h = h.encode("idna").decode("ascii")
    except UnicodeError:
        raise InvalidArgument(f"{what} {host!r} is not a valid host name") from None
    if not all(_LABEL.match(label) for label in h.split(".")):
        raise InvalidArgument(f"{what} {host!r} is not a valid host name")
    return h


def is_blocked(address: str) -> bool:
    """True for destinations no policy can open (metadata, loopback, private, link-local ...)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in ALWAYS_BLOCKED if net.version == ip.version)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One allow/deny entry: an exact name, ``*.suffix`` (subdomains only) or a CIDR."""

    pattern: str

    @staticmethod
    def parse(text: object, what: str) -> Rule:
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgument(f"{what} entries must be non-empty strings, got {text!r}")
        t = text.strip().lower()
        if "/" in t:
            try:
                return Rule(str(ipaddress.ip_network(t, strict=False)))
            except ValueError:
                raise InvalidArgument(f"{what} entry {text!r} is not a valid CIDR") from None
        if t.startswith("*."):
            return Rule("*." + normalize_host(t[2:], f"{what} entry"))
        if "*" in t:
            raise InvalidArgument(f"{what} entry {text!r}: a wildcard is only allowed as a leading '*.'")
        return Rule(normalize_host(t, f"{what} entry"))

    @property
    def is_cidr(self) -> bool:
        return "/" in self.pattern

    def matches_name(self, host: str) -> bool:
        if self.is_cidr:
            return False
        if self.pattern.startswith("*."):
            return host.endswith(self.pattern[1:])
        return host == self.pattern

    def matches_address(self, address: str) -> bool:
        if not self.is_cidr:
            return address == self.pattern
        try:
            return ipaddress.ip_address(address) in ipaddress.ip_network(self.pattern)
        except ValueError:
            return False


@dataclasses.dataclass(frozen=True)
class Network:
    """An allowlist policy. ``allow``/``deny``: host names, ``*.example.com`` (its subdomains),
    IP addresses, CIDRs or a preset's name (``pypi``, ``npm``, ``github``, ...: the hosts that
    registry's client needs, :data:`PRESETS` and ``[network.presets]``); deny wins. An allowed
    CIDR opens IP literals in it, not names that happen to resolve into it. ``on_unknown``:
    ``"deny"`` or ``"ask"`` (an approval hook decides, before the name is looked up; without an
    answer in time, deny)."""

    allow: Sequence[str] = ()
    deny: Sequence[str] = ()
    on_unknown: OnUnknown = "deny"

    def __post_init__(self) -> None:
        for name in ("allow", "deny"):
            v = getattr(self, name)
            if isinstance(v, str) or not isinstance(v, (list, tuple)):
                raise InvalidArgument(f"Network.{name} must be a list of strings, got {v!r}")
            object.__setattr__(self, name, tuple(Rule.parse(x, f"Network.{name}").pattern for x in v))
        if self.on_unknown not in ("deny", "ask"):
            raise InvalidArgument(f"Network.on_unknown must be 'deny' or 'ask', got {self.on_unknown!r}")


@dataclasses.dataclass(frozen=True)
class Policy:
    """The normalised policy the proxy enforces (``mode`` none | allowlist | internet)."""

    mode: Literal["none", "allowlist", "internet"]
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    on_unknown: OnUnknown = "deny"

    @staticmethod
    def of(spec: object, presets: Mapping[str, Sequence[str]] = PRESETS, always: Sequence[str] = ()) -> Policy:
        """The policy ``spec`` asks for, an allow or deny entry naming one of ``presets`` replaced
        by its hosts; ``always``: hosts an allowlist gets whatever it says (the operator's package
        mirrors: ``[network]`` ``pip_index_url``, ``npm_registry``)."""
        if spec is None or spec == "none":
            return Policy("none")
        if spec == "internet":
            return Policy("internet")
        if isinstance(spec, Policy):
            return spec
        if isinstance(spec, Network):
            allow = (*expand(spec.allow, presets), *always)
            return Policy("allowlist", tuple(dict.fromkeys(allow)), expand(spec.deny, presets), spec.on_unknown)
        raise InvalidArgument(f"network must be 'none', 'internet' or warmbox.Network(...), got {spec!r}")

    @property
    def enabled(self) -> bool:
        """Does the sandbox need a link at all? (``none`` keeps only loopback.)"""
        return self.mode != "none"

    def with_allowed(self, host: str) -> Policy:
        if host in self.allow:
            return self
        return dataclasses.replace(
            self, mode="allowlist" if self.mode == "none" else self.mode, allow=(*self.allow, host)
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Policy:
        d = json.loads(text)
        return Policy(d["mode"], tuple(d["allow"]), tuple(d["deny"]), d["on_unknown"])

    def describe(self) -> str:
        if self.mode != "allowlist":
            return self.mode
        parts = [f"allow {', '.join(self.allow) or '(nothing)'}"]
        if self.deny:
            parts.append(f"deny {', '.join(self.deny)}")
        if self.on_unknown == "ask":
            parts.append("ask for others")
        return "; ".join(parts)

    # ---- decisions

    def decide_name(self, host: str) -> tuple[Decision | Literal["ask"], str]:
        """Decision for a destination as the sandbox named it, made *before* any lookup.

        ``host`` is a normalised name or IP literal. Names are decided by name rules only: an
        unknown name is denied (or ``"ask"``), never resolved to see whether a CIDR rule would
        take it, since the lookup alone would carry the name to the upstream resolver (an
        exfiltration channel). CIDR and IP rules decide IP literals; for the addresses of an
        allowed name see :meth:`denies_address`. The always-blocked ranges are the caller's
        check, on the address it connects to.
        """
        if self.mode == "none":
            return "deny", "policy:none"
        literal = is_ip(host)
        hit = _first(self.deny, lambda r: r.matches_address(host) if literal else r.matches_name(host))
        if hit:
            return "deny", f"deny:{hit}"
        if self.mode == "internet":
            return "allow", "internet"
        hit = _first(self.allow, lambda r: r.matches_address(host) if literal else r.matches_name(host))
        if hit:
            return "allow", f"allow:{hit}"
        return ("ask", "") if self.on_unknown == "ask" else ("deny", "default-deny")

    def denies_address(self, address: str) -> str:
        """The deny rule (CIDR or IP) that refuses ``address``, a resolved address of an allowed
        name ("" if none: allow rules add nothing to a name already allowed)."""
        hit = _first(self.deny, lambda r: r.matches_address(address))
        return f"deny:{hit}" if hit else ""


def expand(patterns: Sequence[str], presets: Mapping[str, Sequence[str]] = PRESETS) -> tuple[str, ...]:
    """``patterns`` with each preset's name replaced by its hosts (order kept, no repeats)."""
    out: list[str] = []
    for x in patterns:
        out.extend(presets.get(x, (x,)))
    return tuple(dict.fromkeys(out))


def preset_of(host: str, presets: Mapping[str, Sequence[str]] = PRESETS) -> str:
    """The name of a preset that has ``host`` ("" if none)."""
    return next((name for name, hosts in presets.items() if host in hosts), "")


def refusal(host: str, port: int, rule: str) -> str:
    """Why the proxy refused ``host:port`` under ``rule``, and how to allow it, in one line of
    printable ASCII (it is the 403's reason phrase, which pip and curl -v print)."""
    dest = f"{host}:{port}"
    name = preset_of(host) or host
    allow = f'add it to the allowlist: Network(allow=[..., "{name}"]) or warmbox run --allow {name}'
    if rule == "default-deny":
        why = f"{dest} is not on the allowlist of this sandbox; {allow}"
    elif rule.startswith("deny:"):
        why = f"{dest} matches the deny rule {rule[5:]} (deny wins over allow); remove it from Network(deny=[...])"
    elif rule == "policy:none":
        why = f"this sandbox has no network (policy none); {allow}"
    elif rule == "blocked-address":
        why = f"{dest} is a private, loopback, link-local or metadata address, which no policy opens"
    elif rule == "unresolvable":
        why = f"{host} does not resolve"
    elif rule.startswith("approval:"):
        why = f"{dest} was not approved ({rule}); {allow}"
    else:
        why = f"{dest} refused ({rule})"
    return "".join(c if " " <= c <= "~" else "?" for c in why)[:400]


def is_ip(host: str) -> bool:
    """Is ``host`` an IP literal (rather than a name)?"""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _first(patterns: tuple[str, ...], test) -> str:
    """The first pattern whose rule passes ``test`` ("" if none)."""
    return next((x for x in patterns if test(Rule(x))), "")


@dataclasses.dataclass(frozen=True)
class Secret:
    """A credential the sandbox may use but never sees.

    The sandbox's env holds a placeholder; the proxy swaps it for ``value`` in request headers
    sent to ``hosts`` (exact names or ``*.`` wildcards) only, over HTTPS it terminates with a
    per-sandbox CA the sandbox trusts. Requests to other hosts carry the inert placeholder.
    """

    value: str
    hosts: Sequence[str]

    def __post_init__(self) -> None:
        if not isinstance(self.value, str) or not self.value or any(c in self.value for c in "\r\n\0"):
            raise InvalidArgument("Secret.value must be a non-empty string without CR, LF or NUL")
        if isinstance(self.hosts, str) or not isinstance(self.hosts, (list, tuple)) or not self.hosts:
            raise InvalidArgument("Secret.hosts must be a non-empty list of host names")
        hosts = tuple(Rule.parse(h, "Secret.hosts").pattern for h in self.hosts)
        if any(Rule(h).is_cidr for h in hosts):
            raise InvalidArgument("Secret.hosts must be host names, not CIDRs")
        object.__setattr__(self, "hosts", hosts)

    def __repr__(self) -> str:  # never print the value
        return f"Secret(value='***', hosts={list(self.hosts)!r})"

    def applies_to(self, host: str) -> bool:
        return any(Rule(h).matches_name(host) for h in self.hosts)
