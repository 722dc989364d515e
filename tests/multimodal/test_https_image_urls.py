"""https image URLs against a real TLS server on 127.0.0.1 whose certificates a test CA signed
(made here with the `openssl` binary): trusted through NANOSERVE_MEDIA_CA_BUNDLE (or OpenSSL's
own SSL_CERT_FILE), the image is fetched over TLS and answers as its data: URL; a certificate for
another host name, or one no trusted CA signed, is a 400 naming the part's field; loopback is
reached only when --allowed-media-domains names the host."""

from __future__ import annotations

import http.server
import shutil
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.chat import chat_images
from nanoserve.multimodal.fetch import FetchPolicy
from tests.multimodal.test_image_urls import png_bytes
from tests.multimodal.test_images_api import image_message, post_chat
from tests.multimodal.test_llava import GREEDY
from tests.multimodal.test_preprocessing import data_url, random_image
from tests.server.conftest import ServerHandle

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

IMAGE = random_image(66, 52, "RGB", 51)
FIELD = "messages[0].content[0].image_url.url"
CA_CONFIG = """[req]
distinguished_name = dn
prompt = no
[dn]
CN = nanoserve test CA
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
"""
LEAF_EXTENSIONS = """basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:{name}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(folder: Path, name: str) -> None:
    """folder/{name}.pem and .key: a self-signed CA."""
    (folder / "ca.cnf").write_text(CA_CONFIG)
    openssl(
        "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-config", "ca.cnf", "-extensions", "v3_ca", cwd=folder,
    )  # fmt: skip


def make_leaf(folder: Path, ca: str, host: str, serial: int) -> tuple[Path, Path]:
    """A server certificate for `host` that the CA `ca` signed, and its key."""
    stem = f"{ca}-{host}"
    (folder / f"{stem}.ext").write_text(LEAF_EXTENSIONS.format(name=host))
    openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{stem}.key", "-out", f"{stem}.csr", "-subj", f"/CN={host}", cwd=folder,
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", f"{stem}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-set_serial", str(serial), "-days", "2", "-out", f"{stem}.pem",
        "-extfile", f"{stem}.ext", cwd=folder,
    )  # fmt: skip
    return folder / f"{stem}.pem", folder / f"{stem}.key"


class TlsImageServer:
    """http.server over TLS on 127.0.0.1 in a thread, serving /image.png with one certificate."""

    def __init__(self, cert: Path, key: Path) -> None:
        png = png_bytes(IMAGE)
        self.requests = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                owner.requests += 1
                self.send_response(200 if self.path == "/image.png" else 404)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:  # a refused handshake
                pass

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, host: str = "localhost") -> str:
        return f"https://{host}:{self.port}/image.png"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    make_ca(folder, "trusted")
    make_ca(folder, "unknown")
    return folder


@pytest.fixture(scope="module")
def servers(certs):
    """By what their certificate says: localhost, another host, localhost by an unknown CA."""
    made = {
        "localhost": TlsImageServer(*make_leaf(certs, "trusted", "localhost", 11)),
        "other": TlsImageServer(*make_leaf(certs, "trusted", "images.example.com", 12)),
        "unknown-ca": TlsImageServer(*make_leaf(certs, "unknown", "localhost", 13)),
    }
    yield made
    for server in made.values():
        server.close()


@pytest.fixture
def trusted(certs, monkeypatch):
    monkeypatch.setenv("NANOSERVE_MEDIA_CA_BUNDLE", str(certs / "trusted.pem"))
    return FetchPolicy.create(["localhost"])


def fetch(url: str, policy: FetchPolicy):
    return chat_images(image_message(url), None, policy)


def refusal(url: str, policy: FetchPolicy) -> str:
    with pytest.raises(InvalidRequestError) as error:
        fetch(url, policy)
    assert error.value.param == FIELD
    return str(error.value)


def test_an_https_url_is_fetched_over_tls(servers, trusted):
    server = servers["localhost"]
    before = server.requests
    (image,) = fetch(server.url(), trusted)
    assert image.tobytes() == IMAGE.tobytes() and image.size == IMAGE.size
    assert server.requests == before + 1


def test_the_host_name_is_verified(servers, trusted):
    server = servers["other"]  # its certificate names images.example.com
    before = server.requests
    message = refusal(server.url(), trusted)
    assert "TLS certificate of the image URL's host 'localhost' could not be verified" in message
    assert "Hostname mismatch" in message
    assert server.requests == before  # no request went over the unverified connection


def test_a_certificate_no_trusted_ca_signed_is_refused(servers, trusted):
    message = refusal(servers["unknown-ca"].url(), trusted)
    assert "could not be verified" in message and "NANOSERVE_MEDIA_CA_BUNDLE" in message


def test_without_the_bundle_the_test_ca_is_not_trusted(servers, monkeypatch):
    monkeypatch.delenv("NANOSERVE_MEDIA_CA_BUNDLE", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    assert "could not be verified" in refusal(
        servers["localhost"].url(), FetchPolicy.create(["localhost"])
    )


def test_openssls_ssl_cert_file_is_honoured(servers, certs, monkeypatch):
    monkeypatch.delenv("NANOSERVE_MEDIA_CA_BUNDLE", raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", str(certs / "trusted.pem"))
    (image,) = fetch(servers["localhost"].url(), FetchPolicy.create(["localhost"]))
    assert image.tobytes() == IMAGE.tobytes()


def test_loopback_over_https_needs_the_allowlist(servers, certs, monkeypatch):
    monkeypatch.setenv("NANOSERVE_MEDIA_CA_BUNDLE", str(certs / "trusted.pem"))
    server = servers["localhost"]
    before = server.requests
    assert "not a public address" in refusal(server.url(), FetchPolicy.create(None))
    assert "not in --allowed-media-domains" in refusal(
        server.url(), FetchPolicy.create(["images.example.com"])
    )
    assert server.requests == before


def test_a_bad_bundle_fails_at_start(tmp_path, monkeypatch):
    bad = tmp_path / "bundle.pem"
    bad.write_text("not a certificate\n")
    for path in (bad, tmp_path / "missing.pem"):
        monkeypatch.setenv("NANOSERVE_MEDIA_CA_BUNDLE", str(path))
        with pytest.raises(ValueError, match="NANOSERVE_MEDIA_CA_BUNDLE=.*not a readable PEM"):
            FetchPolicy.create(None)


def test_the_server_answers_an_https_image_as_its_data_url(llava_dir, servers, certs):
    with pytest.MonkeyPatch.context() as env:  # read once, at start
        env.setenv("NANOSERVE_MEDIA_CA_BUNDLE", str(certs / "trusted.pem"))
        env.setenv("NANOSERVE_IMAGE_FETCH_TIMEOUT", "120")
        handle = ServerHandle(
            llava_dir,
            engine_kwargs={
                "dtype": "float32",
                "num_kv_blocks": 32,
                "allowed_media_domains": ["localhost"],
            },
        )
    try:
        client = handle.client()
        model = client.models.list().data[0].id

        def answer(url: str) -> tuple[str, int]:
            response = client.chat.completions.create(
                model=model,
                messages=image_message(url),
                temperature=0,
                max_tokens=GREEDY.max_tokens,
            )
            return response.choices[0].message.content, response.usage.prompt_tokens

        assert answer(servers["localhost"].url()) == answer(data_url(IMAGE))
        status, body = post_chat(handle.port, image_message(servers["other"].url()))
        assert status == 400 and body["error"]["param"] == FIELD
        assert "Hostname mismatch" in body["error"]["message"]
    finally:
        handle.close()
