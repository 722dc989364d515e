"""http(s) image URLs, fetched from a real HTTP server on 127.0.0.1 started here: a fetched image
gives the greedy tokens of the same image sent as a data: URL (a real nanoserve server and the
`openai` client; LLM.chat); each refusal (a host outside the allowlist, a non-public address, a
redirect to a host not allowed, a body over the limit, a 404, a body that is no image, a server
that never answers) is a 400 naming the part's field. No test reaches beyond 127.0.0.0/8."""

from __future__ import annotations

import http.server
import io
import socket
import threading

import pytest
from PIL import Image

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.chat import chat_images
from nanoserve.multimodal.fetch import CHUNK, MAX_REDIRECTS, FetchPolicy, is_public_address
from nanoserve.multimodal.image import ImageLimits
from tests.multimodal.test_images_api import image_message, post_chat
from tests.multimodal.test_llava import GREEDY, make_llm
from tests.multimodal.test_preprocessing import data_url, random_image
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

IMAGE = random_image(72, 60, "RGB", 31)
FIELD = "messages[0].content[0].image_url.url"
LOCAL = FetchPolicy(frozenset({"127.0.0.1"}), timeout=30.0)  # the image server's host allowed
HUGE = 64 * 1024 * 1024  # the bytes /huge would send if the client read them all


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class ImageServer:
    """http.server on 127.0.0.1 in a thread: /image.png, a 302 to it, 302s elsewhere, a 404,
    a text body, a huge body (with or without Content-Length; bytes written counted), and
    /hang, which accepts and answers nothing until `release` is set."""

    def __init__(self) -> None:
        self.png = png_bytes(IMAGE)
        self.release = threading.Event()
        # /hang-until: `entered` when a fetch reached it, then held until `let_go`
        self.entered, self.let_go = threading.Event(), threading.Event()
        self.sent = {"huge": 0, "huge-declared": 0}
        self.done = {name: threading.Event() for name in self.sent}  # its handler returned
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                path = self.path
                if path == "/image.png":
                    self.reply(200, owner.png, "image/png")
                elif path.startswith("/redirect-to/"):
                    self.send_response(302)
                    self.send_header("Location", path[len("/redirect-to/") :])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif path == "/text":
                    self.reply(200, b"this is not an image", "text/plain")
                elif path in ("/huge", "/huge-declared"):
                    self.huge(path[1:])
                elif path == "/hang":
                    owner.release.wait()
                elif path == "/hang-until":
                    owner.entered.set()
                    owner.let_go.wait()
                else:
                    self.reply(404, b"not found", "text/plain")

            def reply(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def huge(self, name: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                if name == "huge-declared":
                    self.send_header("Content-Length", str(HUGE))
                self.send_header("Connection", "close")
                self.end_headers()
                block = owner.png.ljust(CHUNK, b"\0")
                try:
                    while owner.sent[name] < HUGE:
                        self.wfile.write(block)
                        self.wfile.flush()
                        owner.sent[name] += len(block)
                except OSError:  # the client stopped reading and closed
                    pass
                finally:
                    owner.done[name].set()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.release.set()
        self.let_go.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def images():
    server = ImageServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def url_server(llava_dir):
    with pytest.MonkeyPatch.context() as env:  # read once, at start
        env.setenv("NANOSERVE_IMAGE_FETCH_TIMEOUT", "120")
        handle = ServerHandle(
            llava_dir,
            engine_kwargs={
                "dtype": "float32",
                "num_kv_blocks": 64,
                "allowed_media_domains": ["127.0.0.1"],
            },
        )
    yield handle
    handle.close()


def fetch(url: str, policy: FetchPolicy = LOCAL, limits: ImageLimits | None = None):
    return chat_images(image_message(url), limits, policy)


def refusal(url: str, policy: FetchPolicy = LOCAL, limits: ImageLimits | None = None) -> str:
    with pytest.raises(InvalidRequestError) as error:
        fetch(url, policy, limits)
    assert error.value.param == FIELD
    return str(error.value)


def test_a_fetched_image_answers_as_its_data_url(url_server, images):
    client = url_server.client()
    model = client.models.list().data[0].id

    def answer(url: str) -> tuple[str, int]:
        response = client.chat.completions.create(
            model=model, messages=image_message(url), temperature=0, max_tokens=GREEDY.max_tokens
        )
        return response.choices[0].message.content, response.usage.prompt_tokens

    expected = answer(data_url(IMAGE))
    assert answer(images.url("/image.png")) == expected
    # a redirect to an allowed URL is followed
    assert answer(images.url("/redirect-to/" + images.url("/image.png"))) == expected


def test_llm_chat_fetches_too(llava_dir, images):
    llm = make_llm(llava_dir, num_kv_blocks=32, allowed_media_domains=["127.0.0.1"])
    fetched, inline = (
        llm.chat(image_message(url), GREEDY)[0].outputs[0].token_ids
        for url in (images.url("/image.png"), data_url(IMAGE))
    )
    assert fetched == inline


@pytest.mark.parametrize(
    "path, host, message",
    [
        ("/image.png", "localhost", "host 'localhost' is not in --allowed-media-domains"),
        ("/missing.png", "127.0.0.1", "got HTTP 404"),
        ("/text", "127.0.0.1", "could not be decoded"),
        ("/redirect-to/http://127.0.0.2:1/image.png", "127.0.0.1", "'127.0.0.2' is not in"),
        ("/redirect-to/http://localhost:1/image.png", "127.0.0.1", "'localhost' is not in"),
        ("/redirect-to/ftp://127.0.0.1/image.png", "127.0.0.1", "not 'ftp'"),
    ],
)
def test_refusals_over_the_api_are_400s_naming_the_part(url_server, images, path, host, message):
    status, body = post_chat(url_server.port, image_message(images.url(path, host)))
    assert status == 400, body
    assert body["error"]["param"] == FIELD
    assert message in body["error"]["message"]


def test_a_fetch_does_not_block_the_server(url_server, images):
    """While a fetch waits on an image server that does not answer, the server answers other
    requests; the image server hanging up is then a 400."""
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(
            reply=post_chat(url_server.port, image_message(images.url("/hang-until")))
        )
    )
    thread.start()
    images.entered.wait()
    status, _, _ = http_request(url_server.port, "GET", "/health")
    assert status == 200 and "reply" not in result
    images.let_go.set()
    thread.join()
    status, body = result["reply"]
    assert status == 400 and body["error"]["param"] == FIELD
    assert "could not be fetched" in body["error"]["message"]


def test_a_loopback_host_is_refused_by_default(images):
    message = refusal(images.url("/image.png"), FetchPolicy())
    assert "resolves to 127.0.0.1, which is not a public address" in message
    # the same image once the host is allowed by name
    assert fetch(images.url("/image.png"))[0].tobytes() == IMAGE.tobytes()


def test_a_redirect_is_refused_when_redirects_are_off(images):
    off = FetchPolicy(LOCAL.allowed_domains, LOCAL.timeout, allow_redirects=False)
    assert "redirects are not followed" in refusal(
        images.url("/redirect-to/" + images.url("/image.png")), off
    )
    chain = images.url("/image.png")
    for _ in range(MAX_REDIRECTS + 1):
        chain = images.url("/redirect-to/" + chain)
    assert f"redirects more than {MAX_REDIRECTS} times" in refusal(chain)
    assert fetch(chain.split("/redirect-to/", 1)[1])[0].tobytes() == IMAGE.tobytes()


@pytest.mark.parametrize("name", ["huge", "huge-declared"])
def test_a_body_over_the_limit_is_refused_and_reading_stops(images, name):
    limit = 200_000
    message = refusal(images.url("/" + name), limits=ImageLimits(max_bytes=limit))
    assert f"limit of {limit}" in message
    # The client stops at the limit + one chunk (a declared length: before reading); what the
    # server got written is that, plus what the kernel's socket buffers held.
    images.done[name].wait()  # the count is final: the handler's write failed or it ended
    assert images.sent[name] <= limit + CHUNK + 16 * 1024 * 1024 < HUGE


def test_connection_refused_is_a_400():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert "could not be fetched" in refusal(f"http://127.0.0.1:{port}/image.png")


def test_a_server_that_never_answers_times_out(images):
    quick = FetchPolicy(LOCAL.allowed_domains, timeout=0.5)
    assert "took longer than 0.5 seconds" in refusal(images.url("/hang"), quick)


@pytest.mark.parametrize(
    "address, public",
    [
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("172.31.255.255", False),
        ("192.168.1.1", False),
        ("127.0.0.1", False),
        ("127.8.9.10", False),
        ("::1", False),
        ("fe80::1", False),
        ("fe80::1%eth0", False),
        ("169.254.169.254", False),  # cloud metadata services
        ("0.0.0.0", False),
        ("::", False),
        ("100.64.0.1", False),  # carrier-grade NAT
        ("fc00::1", False),
        ("224.0.0.1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped loopback
        ("::ffff:10.0.0.1", False),
        ("8.8.8.8", True),
        ("1.1.1.1", True),
        ("2606:4700:4700::1111", True),
        ("::ffff:8.8.8.8", True),
    ],
)
def test_address_check(address, public):
    assert is_public_address(address) is public


def test_the_flag_and_the_environment(monkeypatch):
    import argparse

    from nanoserve.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--allowed-media-domains", "a.example", "B.example."])
    config = engine_config_from_args(args)
    assert config.allowed_media_domains == ["a.example", "B.example."]
    assert engine_config_from_args(parser.parse_args([])).allowed_media_domains is None
    for name in ("NANOSERVE_IMAGE_FETCH_TIMEOUT", "NANOSERVE_MEDIA_URL_ALLOW_REDIRECTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "2.5")
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    policy = FetchPolicy.create(config.allowed_media_domains)
    assert policy == FetchPolicy(frozenset({"a.example", "b.example"}), 2.5, False)
    monkeypatch.setenv("NANOSERVE_IMAGE_FETCH_TIMEOUT", "-1")  # not positive: the default
    monkeypatch.setenv("NANOSERVE_MEDIA_URL_ALLOW_REDIRECTS", "1")
    assert FetchPolicy.create(None) == FetchPolicy(None, 5.0, True)


def test_a_host_whose_first_address_refuses_is_reached_at_the_next(images):
    """A host's addresses are tried in the resolver's order (an unreachable IPv6 address before
    a working IPv4 one, say): a refused connection moves on to the next checked address."""
    import time

    from nanoserve.multimodal.fetch import _Fetch

    refusing = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    refusing.bind(("127.0.0.1", 0))  # bound, never listening: a connection to it is refused
    try:
        addresses = [
            (socket.AF_INET, socket.SOCK_STREAM, 6, refusing.getsockname()),
            (socket.AF_INET, socket.SOCK_STREAM, 6, ("127.0.0.1", images.port)),
        ]
        fetch = _Fetch(LOCAL, 1024, FIELD, time.monotonic() + 30)
        opened: list[socket.socket] = []
        sock = fetch.connect(addresses, opened)
        assert sock.getpeername() == ("127.0.0.1", images.port)
        assert len(opened) == 2
        for each in opened:
            each.close()
        with pytest.raises(ConnectionRefusedError):  # none takes it: the last failure
            fetch.connect(addresses[:1], opened)
        opened[-1].close()
    finally:
        refusing.close()
