"""Image URLs whose IPv6 address carries an IPv4 one (NAT64, 6to4, IPv4-mapped) are checked as
that IPv4 address: 64:ff9b::a9fe:a9fe reaches 169.254.169.254 through a NAT64 gateway. The
refusal is a 400 naming the part, made before any connection."""

from __future__ import annotations

import pytest

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.chat import chat_images
from nanoserve.multimodal.fetch import is_public_address
from tests.multimodal.test_images_api import image_message


@pytest.mark.parametrize(
    "address, public",
    [
        ("64:ff9b::7f00:1", False),  # NAT64 of 127.0.0.1
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 of 169.254.169.254
        ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1
        ("64:ff9b::808:808", True),  # NAT64 of 8.8.8.8
        ("64:ff9b:1::808:808", False),  # NAT64's local-use prefix (RFC 8215)
        ("2002:7f00:1::", False),  # 6to4 of 127.0.0.1
        ("2002:a9fe:a9fe::1", False),  # 6to4 of 169.254.169.254
        ("2002:808:808::1", True),  # 6to4 of 8.8.8.8
        ("::ffff:7f00:1", False),  # IPv4-mapped loopback, hex-written
        ("2606:4700:4700::1111", True),
    ],
)
def test_embedded_ipv4_addresses_are_checked_as_ipv4(address, public):
    assert is_public_address(address) is public


@pytest.mark.parametrize("host", ["[64:ff9b::7f00:1]", "[2002:7f00:1::]"])
def test_a_url_to_one_is_refused_before_connecting(host, monkeypatch):
    import socket

    def no_connection(*args, **kwargs):
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket, "create_connection", no_connection)
    monkeypatch.setattr(socket.socket, "connect", no_connection)
    with pytest.raises(InvalidRequestError, match="not a public address") as error:
        chat_images(image_message(f"http://{host}/cat.png"))
    assert error.value.param == "messages[0].content[0].image_url.url"
