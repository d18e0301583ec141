"""Fetching an image URL a request names: only when allowed (``allow_image_urls``), only from public
addresses unless ``allow_private_image_urls``, bounded in bytes and in time.

A client must not be able to make the server reach its own network (SSRF): the host is resolved here,
every address it resolves to is checked, and the connection goes to the checked address (the URL's
host kept for the Host header and TLS's SNI and certificate check), so a second DNS answer cannot
differ from the one checked (rebinding). Redirects are followed by hand, each hop checked again. A
proxy from the environment is not used: it would connect wherever the name leads.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

from cllm.config import ImageConfig
from cllm.multimodal.decode import check_bytes

Resolver = Callable[[str, int], list[str]]  # (host, port) -> its addresses
_MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_HEADERS = {"User-Agent": "cllm image fetch", "Accept": "image/*"}


def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver)."""
    return list(dict.fromkeys(str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))


def is_public(address: str) -> bool:
    """Whether an address is on the public internet: not private, loopback, link-local, shared (CGNAT),
    reserved, unspecified or multicast -- also when it is an IPv4 address inside an IPv6 one (mapped,
    6to4, Teredo, NAT64), which reaches the IPv4 address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope (fe80::1%eth0) is not part of it
    if not ip.is_global or ip.is_multicast:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        inner = [ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())]
        if ip in _NAT64:
            inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        return all(is_public(str(v4)) for v4 in inner if v4 is not None)
    return True


def fetch_image(url: str, where: str, settings: ImageConfig, *, transport: Any = None,
                resolve: Resolver = resolve_host) -> bytes:
    """The body at ``url`` (sync: the Python API). ValueError naming ``where`` when URLs are off, the
    address is not allowed, or the fetch fails, times out or exceeds max_image_bytes."""
    import httpx

    deadline = time.monotonic() + settings.image_url_timeout_s
    try:
        with httpx.Client(transport=transport, timeout=settings.image_url_timeout_s, trust_env=False) as client:
            for _ in range(_MAX_REDIRECTS + 1):
                hop = plan_hop(url, where, settings, resolve)
                with client.stream("GET", hop.url, headers=hop.headers, extensions=hop.extensions) as response:
                    body = _Body(response, url, where, settings, deadline)
                    if body.next_url is None:
                        for chunk in response.iter_bytes():
                            body.add(chunk)
                        return body.data()
                    url = body.next_url
    except httpx.TimeoutException:
        raise _timed_out(where, settings) from None
    except (httpx.HTTPError, httpx.InvalidURL, OSError, UnicodeError) as exc:
        raise _failed(where, exc) from None
    raise ValueError(f"{where}: image URL redirects more than {_MAX_REDIRECTS} times")


async def fetch_image_async(url: str, where: str, settings: ImageConfig, *, transport: Any = None,
                            resolve: Resolver = resolve_host) -> bytes:
    """``fetch_image`` for the server's event loop: nothing blocks it (resolving runs in a thread), and
    ``image_url_timeout_s`` bounds the whole fetch."""
    try:
        return await asyncio.wait_for(_fetch_async(url, where, settings, transport, resolve),
                                      settings.image_url_timeout_s)
    except asyncio.TimeoutError:
        raise _timed_out(where, settings) from None


async def _fetch_async(url: str, where: str, settings: ImageConfig, transport: Any, resolve: Resolver) -> bytes:
    import httpx

    try:
        async with httpx.AsyncClient(transport=transport, timeout=settings.image_url_timeout_s,
                                     trust_env=False) as client:
            for _ in range(_MAX_REDIRECTS + 1):
                hop = await asyncio.to_thread(plan_hop, url, where, settings, resolve)
                async with client.stream("GET", hop.url, headers=hop.headers, extensions=hop.extensions) as response:
                    body = _Body(response, url, where, settings, None)
                    if body.next_url is None:
                        async for chunk in response.aiter_bytes():
                            body.add(chunk)
                        return body.data()
                    url = body.next_url
    except httpx.TimeoutException:
        raise _timed_out(where, settings) from None
    except (httpx.HTTPError, httpx.InvalidURL, OSError, UnicodeError) as exc:
        raise _failed(where, exc) from None
    raise ValueError(f"{where}: image URL redirects more than {_MAX_REDIRECTS} times")


@dataclass(slots=True)
class Hop:
    """One request of a fetch: where it connects, and what it says it asks for."""

    url: str  # the URL requested, its host replaced by the checked address when the address was checked
    headers: dict[str, str] = field(default_factory=dict)  # Host: the URL's host when it was replaced
    extensions: dict[str, Any] = field(default_factory=dict)  # sni_hostname: TLS names (and checks) the real host


def plan_hop(url: str, where: str, settings: ImageConfig, resolve: Resolver = resolve_host) -> Hop:
    """The request for ``url`` under the URL policy (ValueError naming ``where`` when it is refused)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ValueError(f"{where}: image URL is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"{where}: image URL must be a data: URL (data:image/png;base64,...) or an http(s) URL")
    if not settings.allow_image_urls:
        raise ValueError(f"{where}: image URLs are not fetched (allow_image_urls is off): send the image inline as a "
                         "data: URL (data:image/png;base64,...), or turn on allow_image_urls (--set "
                         "allow_image_urls=true, CLLM_ALLOW_IMAGE_URLS=true, LLM(allow_image_urls=True))")
    if settings.allow_private_image_urls:
        return Hop(url, dict(_HEADERS))
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"{where}: image URL host {host!r} does not resolve ({exc})") from None
    refused = [a for a in addresses if not is_public(a)]
    if refused or not addresses:
        raise ValueError(f"{where}: image URL host {host!r} resolves to {', '.join(refused) or 'nothing'}: a private, "
                         "loopback, link-local or reserved address, which this server does not fetch from "
                         "(allow_private_image_urls: true lifts this)")
    import httpx

    pinned = httpx.URL(url).copy_with(host=addresses[0].split("%", 1)[0])
    netloc = parts.netloc.rpartition("@")[2]  # host[:port], without credentials
    return Hop(str(pinned), {**_HEADERS, "Host": netloc}, {"sni_hostname": host})


class _Body:
    """A response's status and body, checked as they arrive: a redirect's next URL, or the image's bytes
    up to max_image_bytes (and, fetching synchronously, up to the deadline)."""

    def __init__(self, response: Any, url: str, where: str, settings: ImageConfig, deadline: float | None) -> None:
        self._where, self._settings, self._deadline = where, settings, deadline
        self._chunks: list[bytes] = []
        self._size = 0
        self.next_url: str | None = None
        if response.status_code in _REDIRECTS and response.headers.get("location"):
            self.next_url = urljoin(url, response.headers["location"])
            return
        if response.status_code != 200:
            raise ValueError(f"{where}: fetching the image URL gave HTTP {response.status_code}")
        length = response.headers.get("content-length", "")
        if length.isdigit():
            check_bytes(int(length), where, settings)

    def add(self, chunk: bytes) -> None:
        self._size += len(chunk)
        check_bytes(self._size, self._where, self._settings)
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise _timed_out(self._where, self._settings)
        self._chunks.append(chunk)

    def data(self) -> bytes:
        return b"".join(self._chunks)


def _timed_out(where: str, settings: ImageConfig) -> ValueError:
    return ValueError(f"{where}: fetching the image URL took longer than image_url_timeout_s={settings.image_url_timeout_s}")


def _failed(where: str, exc: BaseException) -> ValueError:
    return ValueError(f"{where}: could not fetch the image URL ({type(exc).__name__}: {exc})")
