"""The test servers' ports: one taken between choosing and binding is chosen again,
never a port that was given or one a restart must keep."""

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gpuslice_common.servers import RedisClusterServers, RedisServer, ServerError, _ClusterNode


@pytest.fixture
def squatter() -> Iterator[socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


def _port(s: socket.socket) -> int:
    port: int = s.getsockname()[1]
    return port


def test_a_chosen_port_taken_before_the_start_is_chosen_again(squatter: socket.socket) -> None:
    server = RedisServer(persist=False)
    server.port = _port(squatter)  # taken by another process since it was chosen
    with server:
        assert server.port != _port(squatter)
        with redis.Redis(port=server.port) as client:
            assert client.ping()


def test_a_given_port_that_is_taken_fails_and_names_it(squatter: socket.socket) -> None:
    server = RedisServer(port=_port(squatter), persist=False)
    with pytest.raises(ServerError, match="already in use"):
        server.start()
    server.cleanup()


def test_a_restart_keeps_its_port_even_when_taken(squatter: socket.socket) -> None:
    with RedisServer(persist=False) as server:
        first = server.port
        server.stop()
        server.port = _port(squatter)  # as if another process took the port meanwhile
        with pytest.raises(ServerError, match="already in use"):
            server.start()
        assert server.port == _port(squatter) != first


def test_a_cluster_node_whose_bus_port_is_taken_chooses_both_again(
    squatter: socket.socket, tmp_path: Path
) -> None:
    node = _ClusterNode(tmp_path / "shard")
    node.bus_port = _port(squatter)
    with node:
        assert node.bus_port != _port(squatter)
        with redis.Redis(port=node.port) as client:
            assert client.ping()


def test_a_cluster_that_fails_to_start_stops_the_members_it_started(
    squatter: socket.socket,
) -> None:
    cluster = RedisClusterServers(shards=2)
    first, second = cluster.nodes
    second.port = _port(squatter)
    second._ports_chosen = False  # as a given port: not chosen again, so the start fails
    with pytest.raises(ServerError, match="already in use"), cluster:
        pass
    assert not first.running
    assert first._proc is None
