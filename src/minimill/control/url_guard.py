"""Which addresses a URL a tenant gives (a webhook's) may reach: public ones only.

A webhook is a request the control plane makes on a tenant's behalf, from inside the
operator's network: pointed at 127.0.0.1, ::1, 169.254.169.254 (a cloud's metadata service),
10.0.0.0/8 or fc00::/7 it would reach what no tenant should (the database, the control plane's
own routes, other hosts of the site). So every address a URL's host stands for must be
global: a literal address is checked as it is, a name by what it resolves to, at creation and
again when a delivery connects (the name may resolve elsewhere by then: DNS rebinding; the
delivery then connects to the very address it checked). Operators who deliver to their own
network on purpose allow it (`MINIMILL_WEBHOOK_ALLOW_PRIVATE=1`, `serve
--webhook-allow-private`).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from minimill.control.errors import InvalidRequestError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# Names that mean this host whatever DNS says (RFC 6761).
_LOCAL_NAMES = ("localhost", "localhost.", "ip6-localhost", "ip6-loopback")


def refused_address(address: Address) -> str | None:
    """Why a connection to `address` is refused (None: it is a global unicast address)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or (
            address.teredo[1] if address.teredo else None)
        if embedded is not None:  # ::ffff:127.0.0.1 is 127.0.0.1
            return refused_address(embedded)
    for reason, hit in (("loopback", address.is_loopback),
                        ("unspecified", address.is_unspecified),
                        ("link-local", address.is_link_local),
                        ("multicast", address.is_multicast),
                        ("private", address.is_private)):
        if hit:
            return reason
    # Shared (100.64/10), reserved, documentation and other special ranges.
    return None if address.is_global else "not global"


def host_of(url: str) -> str:
    host = urlsplit(url).hostname
    if not host:
        raise InvalidRequestError("url must have a host", param="url")
    return host


def literal_address(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])  # fe80::1%eth0: its zone dropped
    except ValueError:
        return None


def resolve(host: str, port: int | None) -> list[Address]:
    """Every address `host` stands for (a literal address: itself); [] if it does not resolve.
    Blocking: call it in a thread."""
    literal = literal_address(host)
    if literal is not None:
        return [literal]
    try:
        infos = socket.getaddrinfo(host, port or 443, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    found: list[Address] = []
    for info in infos:
        address = literal_address(str(info[4][0]))
        if address is not None and address not in found:
            found.append(address)
    return found


def check_reachable(url: str, allow_private: bool) -> None:
    """Refuse (400, param url) a URL whose host is, or resolves to, a loopback, link-local,
    private, unspecified or otherwise non-global address. A name that does not resolve now is
    accepted: every delivery checks again (`pick_address`)."""
    if allow_private:
        return
    host = host_of(url).lower()
    if host in _LOCAL_NAMES or host.endswith((".localhost", ".localhost.")):
        raise InvalidRequestError(f"url: {host} is this host; webhooks go to public "
                                  "addresses only", param="url", code="url_not_allowed")
    for address in resolve(host, urlsplit(url).port):
        reason = refused_address(address)
        if reason is not None:
            raise InvalidRequestError(
                f"url: {host} is a {reason} address ({address}); webhooks go to public "
                "addresses only", param="url", code="url_not_allowed")


def pick_address(url: str, allow_private: bool) -> Address:
    """The address a delivery to `url` connects to: the first its host resolves to, when every
    one of them is allowed. Raises ValueError saying why not (no address, or a refused one)."""
    host = host_of(url)
    found = resolve(host, urlsplit(url).port)
    if not found:
        raise ValueError(f"{host} does not resolve")
    if not allow_private:
        for address in found:
            reason = refused_address(address)
            if reason is not None:
                raise ValueError(f"{host} resolves to a {reason} address ({address}): "
                                 "not delivered")
    return found[0]
