"""free_port: a port below the kernel's ephemeral range, which no outgoing connection can be
handed between the pick and the rendezvous's bind (actors/rank_base.py)."""
from __future__ import annotations

import socket

from actors import rank_base
from actors.rank_base import free_port


def test_a_free_port_is_bindable_and_below_the_ephemeral_range():
    top = rank_base._ephemeral_start()
    ports = {free_port() for _ in range(20)}
    assert all(rank_base._LOWEST_PORT <= p < top for p in ports)
    assert len(ports) > 1  # picked at random, not one port for every caller
    port = ports.pop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_given(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        free = free_port()
        picks = iter([busy, busy, free])
        monkeypatch.setattr(rank_base._PICK, "randrange", lambda lo, hi: next(picks))
        assert free_port() == free
