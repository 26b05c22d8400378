"""Another site's script cannot open the live-view websocket with an operator's cookie, even
with the development default ``ALLOWED_HOSTS=*`` (issue 13: such sockets were accepted)."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client

from controlplane import live
from controlplane.asgi import application
from controlplane.ws_origin import same_origin
from tests.factories import UserFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("redis_client")]


def operator_cookie() -> bytes:
    client = Client()
    client.force_login(UserFactory(groups=["viewer"]))
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def connect(origin: bytes) -> tuple[bool, object]:
    cookie = await sync_to_async(operator_cookie)()
    headers = [(b"origin", origin), (b"host", b"cp.example.org:8000"), (b"cookie", cookie)]
    comm = WebsocketCommunicator(application, f"/ws/live/{live.OVERVIEW}/", headers=headers)
    connected, code = await comm.connect(timeout=3)
    await comm.disconnect()
    return connected, code


async def test_a_socket_from_another_site_is_refused_with_a_valid_session() -> None:
    assert "*" in settings.ALLOWED_HOSTS  # the development default this guards
    connected, _ = await connect(b"https://evil.example.com")
    assert not connected


async def test_a_socket_from_our_own_pages_is_accepted() -> None:
    connected, _ = await connect(b"http://cp.example.org:8000")
    assert connected


def test_same_origin_allows_a_default_port_left_out() -> None:
    assert same_origin(urlparse("https://cp.example.org"), "cp.example.org:443")
    assert same_origin(urlparse("http://cp.example.org:80"), "cp.example.org")
    assert not same_origin(urlparse("http://cp.example.org.evil.com"), "cp.example.org")
    assert not same_origin(None, "cp.example.org")
