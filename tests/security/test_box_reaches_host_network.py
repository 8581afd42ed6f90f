"""A box with network reaching for the host: a server the test starts on 127.0.0.1, the
control plane's port, and the private and link-local ranges. Its loopback is its own and its
routes lead nowhere but out (no traffic is sent to a private address here: the box's own
routing table answers). A box without network has no interface but its loopback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from api_harness import ApiEnv
from box_harness import BoxHostProc
from security_harness import assert_healthy

from minimill.client.boxes import Box, Boxes

PROBE = ("import socket, sys\n"
         "try:\n"
         "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), 3).sendall(b'leak')\n"
         "    print('connected')\n"
         "except OSError as e:\n"
         "    print('refused', e.errno)\n")


@pytest.fixture
def host_server() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP server on the host's loopback that records whatever reaches it."""
    server = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                received.append(conn.recv(100))

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1], received
    server.close()


@pytest.fixture
def online(box_host: BoxHostProc, boxes: Boxes) -> Iterator[Box]:
    box = boxes.create(network=True)
    yield box
    box.delete()


def test_a_box_with_network_cannot_reach_the_hosts_loopback(
        online: Box, host_server: tuple[int, list[bytes]], box_env: ApiEnv) -> None:
    port, received = host_server
    control_plane_port = int(box_env.base_url.rsplit(":", 1)[1])
    for target in (port, control_plane_port):
        result = online.exec(["python3", "-c", PROBE, str(target)])
        assert result.stdout.startswith("refused"), result
    assert received == []
    # Its network is its own: an interface of pasta's, and the ranges a control plane, a
    # database or a metadata service live in unreachable by route.
    routes = online.exec("ip -4 route; for a in 10.1.2.3 172.16.0.1 192.168.1.1 "
                         "169.254.169.254 100.64.0.1; do ip route get $a 2>&1; done").stdout
    assert "default via" in routes
    for net in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"):
        assert f"unreachable {net}" in routes
    assert routes.count("No route to host") == 5, routes
    assert "eth0" in online.exec("cat /proc/net/dev").stdout
    assert_healthy(online)


def test_a_box_without_network_has_only_its_loopback(boxes: Boxes,
                                                     box_host: BoxHostProc) -> None:
    box = boxes.create()
    interfaces = [line.split(":")[0].strip() for line in
                  box.exec("cat /proc/net/dev").stdout.splitlines()[2:]]
    assert interfaces == ["lo"]
    box.delete()
