"""Fetching an `http(s)` image URL safely, as vLLM's media connector does: one deadline for the
whole fetch (`NANOSERVE_IMAGE_FETCH_TIMEOUT`), the image's byte limit (reading stops past it),
`--allowed-media-domains`, no connection to a private, loopback, link-local or otherwise
non-global address unless the host is allowed by name, and redirects only to URLs that pass the
same checks. Each refusal and each failure is a 400 naming the field.

The host is resolved once, every address it resolves to is checked, and the socket connects to
a checked address (TLS still verifies the host name, against the system's CA certificates and
NANOSERVE_MEDIA_CA_BUNDLE's): a second DNS answer cannot slip in between the check and the
connection."""

from __future__ import annotations

import concurrent.futures
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from nanoserve import envs
from nanoserve.errors import InvalidRequestError

CHUNK = 64 * 1024  # bytes read at a time: at most the limit + one chunk is ever held
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
DEFAULT_PORTS = {"http": 80, "https": 443}

# getaddrinfo cannot be given a timeout: it runs here, and the caller waits only until the
# deadline (a resolver that hangs keeps one of these threads, never the request).
_resolver = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="nanoserve-dns")


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    """What an image URL may reach: `allowed_domains` (None: any public host; given: only
    these host names, which may then be internal ones), the seconds the fetches of one
    request may take together, whether redirects are followed, and the TLS context https
    URLs are verified with (None: the system's CA certificates)."""

    allowed_domains: frozenset[str] | None = None
    timeout: float = 5.0
    allow_redirects: bool = True
    tls: ssl.SSLContext | None = field(default=None, compare=False, repr=False)

    @classmethod
    def create(cls, allowed_domains: list[str] | str | None) -> FetchPolicy:
        """The policy of --allowed-media-domains and the environment's timeout, redirects and
        extra CA certificates (NANOSERVE_MEDIA_CA_BUNDLE, read now: a bad file fails here)."""
        if isinstance(allowed_domains, str):
            allowed_domains = [allowed_domains]
        domains = (
            None
            if allowed_domains is None
            else frozenset(d.strip().lower().rstrip(".") for d in allowed_domains)
        )
        return cls(
            domains,
            envs.image_fetch_timeout(),
            envs.media_url_allow_redirects(),
            tls_context(envs.media_ca_bundle()),
        )


def tls_context(ca_bundle: str | None) -> ssl.SSLContext:
    """The system's CA certificates (OpenSSL's defaults: SSL_CERT_FILE and SSL_CERT_DIR move
    them), and those of the PEM file `ca_bundle` beside them; host names verified."""
    context = ssl.create_default_context()
    if ca_bundle:
        try:
            context.load_verify_locations(cafile=ca_bundle)
        except (OSError, ssl.SSLError) as error:
            raise ValueError(
                f"NANOSERVE_MEDIA_CA_BUNDLE={ca_bundle}: not a readable PEM file of CA "
                f"certificates ({error})"
            ) from None
    return context


# NAT64's well-known prefix (RFC 6052): a gateway forwards 64:ff9b::a.b.c.d to a.b.c.d, so
# 64:ff9b::a9fe:a9fe reaches 169.254.169.254. Its local-use prefix (RFC 8215) is not public.
NAT64_PREFIX = ipaddress.ip_network("64:ff9b::/96")
NAT64_LOCAL_PREFIX = ipaddress.ip_network("64:ff9b:1::/48")


def is_public_address(address: str) -> bool:
    """Whether a connection to `address` (an IPv4 or IPv6 literal) may leave the host's
    networks: global unicast only (no private, loopback, link-local, shared, reserved,
    unspecified or multicast address; an IPv6 address that carries an IPv4 one, IPv4-mapped,
    6to4 or NAT64, as that IPv4 address)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone id is no part of it
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in NAT64_LOCAL_PREFIX:
            return False
        if ip in NAT64_PREFIX:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        else:
            ip = ip.ipv4_mapped or ip.sixtofour or ip
    return ip.is_global and not ip.is_multicast


class _Fetch:
    """One image's fetch: the URL, then each redirect's, until the body or a refusal."""

    def __init__(self, policy: FetchPolicy, max_bytes: int, field: str, deadline: float) -> None:
        self.policy, self.max_bytes, self.field, self.deadline = policy, max_bytes, field, deadline

    def refuse(self, message: str) -> InvalidRequestError:
        return InvalidRequestError(message, self.field)

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.refuse(
                f"fetching the image URL took longer than {self.policy.timeout:g} seconds "
                "(NANOSERVE_IMAGE_FETCH_TIMEOUT)"
            )
        return left

    def run(self, url: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            status, location, body = self.get(url)
            if status not in REDIRECTS:
                return body
            if not self.policy.allow_redirects:
                raise self.refuse(
                    f"the image URL redirects (HTTP {status}) and redirects are not followed "
                    "(NANOSERVE_MEDIA_URL_ALLOW_REDIRECTS=0)"
                )
            if not location:
                raise self.refuse(f"the image URL redirects (HTTP {status}) to no Location")
            url = urljoin(url, location)
        raise self.refuse(f"the image URL redirects more than {MAX_REDIRECTS} times")

    def target(self, url: str) -> tuple[str, str, int, str]:
        """The URL's scheme, host, port and request path, its host checked against the list."""
        try:
            parts = urlsplit(url)
            port = parts.port or DEFAULT_PORTS.get(parts.scheme.lower(), 0)
        except ValueError:
            raise self.refuse("the image URL is not a valid URL") from None
        scheme, host = parts.scheme.lower(), (parts.hostname or "").rstrip(".")
        if scheme not in DEFAULT_PORTS:
            raise self.refuse(f"an image URL is fetched over http or https, not {scheme!r}")
        if not host:
            raise self.refuse("the image URL has no host")
        allowed = self.policy.allowed_domains
        if allowed is not None and host not in allowed:
            raise self.refuse(f"the image URL's host {host!r} is not in --allowed-media-domains")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return scheme, host, port, path

    def addresses(self, host: str, port: int) -> list[tuple]:
        """The host's socket addresses, in the resolver's order, each checked (unless the host
        is allowed by name)."""
        future = _resolver.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        try:
            infos = future.result(timeout=self.remaining())
        except concurrent.futures.TimeoutError:
            raise self.refuse(f"resolving the image URL's host {host!r} timed out") from None
        except OSError as error:
            raise self.refuse(f"the image URL's host {host!r} does not resolve: {error}") from None
        if not infos:
            raise self.refuse(f"the image URL's host {host!r} does not resolve")
        allowed = self.policy.allowed_domains
        if allowed is None or host not in allowed:
            for *_, sockaddr in infos:
                if not is_public_address(sockaddr[0]):
                    raise self.refuse(
                        f"the image URL's host {host!r} resolves to {sockaddr[0]}, which is not "
                        "a public address (list the host in --allowed-media-domains to allow it)"
                    )
        return [(family, kind, proto, sockaddr) for family, kind, proto, _, sockaddr in infos]

    def connect(self, addresses: list[tuple], opened: list[socket.socket]) -> socket.socket:
        """A socket connected to the first of the checked addresses that takes the connection
        (a host's IPv6 address may be unreachable where its IPv4 one is not)."""
        failure: OSError | None = None
        for family, kind, proto, sockaddr in addresses:
            sock = socket.socket(family, kind, proto)
            opened.append(sock)
            sock.settimeout(self.remaining())
            try:
                sock.connect(sockaddr)
                return sock
            except TimeoutError:
                raise
            except OSError as error:
                failure = error
        assert failure is not None  # addresses() returns at least one
        raise failure

    def get(self, url: str) -> tuple[int, str | None, bytes]:
        """One GET: (status, Location, body) for a redirect or a 200; a refusal otherwise."""
        scheme, host, port, path = self.target(url)
        addresses = self.addresses(host, port)
        # The deadline holds for every step, a server sending one byte at a time included:
        # at the deadline the sockets are shut, and whatever read waits on one ends.
        expired = threading.Event()
        opened: list[socket.socket] = []

        def expire() -> None:
            expired.set()
            for sock in list(opened):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(self.remaining(), expire)
        timer.daemon = True
        timer.start()
        try:
            sock = self.connect(addresses, opened)
            if scheme == "https":
                tls = self.policy.tls or ssl.create_default_context()
                sock = tls.wrap_socket(sock, server_hostname=host)
                opened.append(sock)
            connection_class = (
                http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            )
            connection = connection_class(host, port, timeout=self.remaining())
            connection.sock = sock  # connected to the checked address, not resolved again
            try:
                return self.exchange(connection, path)
            finally:
                connection.close()
        except InvalidRequestError:
            raise
        except ssl.SSLCertVerificationError as error:
            raise self.refuse(
                f"the TLS certificate of the image URL's host {host!r} could not be verified: "
                f"{error.verify_message} (a private CA's certificates: NANOSERVE_MEDIA_CA_BUNDLE)"
            ) from None
        except (OSError, http.client.HTTPException) as error:
            if expired.is_set() or isinstance(error, TimeoutError):
                self.remaining()  # the timeout's message once the deadline has passed
                raise self.refuse(f"fetching the image URL timed out: {error}") from None
            raise self.refuse(f"the image URL could not be fetched: {error}") from None
        finally:
            timer.cancel()
            for sock in opened:
                sock.close()

    def exchange(self, connection: http.client.HTTPConnection, path: str) -> tuple:
        connection.request("GET", path, headers={"Accept": "image/*", "User-Agent": "nanoserve"})
        response = connection.getresponse()
        try:  # the response holds the socket open: closed with it, whatever happens
            return self.read_response(response)
        finally:
            response.close()

    def read_response(self, response: http.client.HTTPResponse) -> tuple:
        if response.status in REDIRECTS:
            return response.status, response.getheader("Location"), b""
        if response.status != 200:
            raise self.refuse(
                f"fetching the image URL got HTTP {response.status} {response.reason}"
            )
        declared = response.getheader("Content-Length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            raise self.refuse(
                f"the image URL's body is {declared} bytes, more than the limit of "
                f"{self.max_bytes} (--max-image-bytes)"
            )
        body = bytearray()
        while chunk := response.read(CHUNK):
            body += chunk
            if len(body) > self.max_bytes:  # stop reading: never more than limit + a chunk
                raise self.refuse(
                    f"the image URL's body is more than the limit of {self.max_bytes} bytes "
                    "(--max-image-bytes)"
                )
        return response.status, None, bytes(body)


def fetch_url(url: str, policy: FetchPolicy, max_bytes: int, field: str, deadline: float) -> bytes:
    """The body of an http(s) image URL, by `deadline` (time.monotonic()); blocking: call it
    from a worker thread in a server."""
    return _Fetch(policy, max_bytes, field, deadline).run(url)
