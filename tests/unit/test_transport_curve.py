"""CurveZMQ on the typed sockets (real ZeroMQ, ipc:// and tcp:// on loopback): the mesh's keys
from `pagemesh keys`, a keyed pair that talks, and rogue peers (raw pyzmq, no keys or other keys)
whose messages never reach a receive loop while the keyed peer is served on."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess

import pytest
import zmq
import zmq.asyncio

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common import transport as t
from pagemesh.common import transport_curve as curve
from pagemesh.common.protocol import Ready, encode
from pagemesh.common.python_command import python_module
from pagemesh.tests.unit.test_transport import free_tcp_port, run

READY = Ready(service="worker", name="w")


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("zmq-keys") / "keys")
    curve.make_keys(folder)
    return folder


@pytest.fixture
def keyed(keys_dir, monkeypatch):
    monkeypatch.setenv(curve.KEYS_ENV, keys_dir)
    return curve.load_keys(keys_dir)


@pytest.fixture(params=["ipc", "tcp"])
def address(request, tmp_path):
    if request.param == "ipc":
        return t.ipc_address(str(tmp_path), "sock")
    return t.tcp_address("127.0.0.1", free_tcp_port())


def test_pagemesh_keys_writes_a_keypair_once_and_the_secret_for_its_owner_only(tmp_path):
    folder = tmp_path / "keys"
    cli = [*python_module("pagemesh.services.cli"), "keys", str(folder)]
    made = subprocess.run(cli, capture_output=True, text=True, timeout=HANG_S)
    assert made.returncode == 0, made.stderr
    assert f"--zmq-keys {folder}" in made.stdout
    keys = curve.load_keys(str(folder))
    assert zmq.curve_public(keys.secret) == keys.public
    assert stat.S_IMODE(os.stat(folder / "mesh.key_secret").st_mode) == 0o600
    secret_before = (folder / "mesh.key_secret").read_bytes()
    again = subprocess.run(cli, capture_output=True, text=True, timeout=HANG_S)
    assert again.returncode == 1 and "exists" in again.stderr
    assert (folder / "mesh.key_secret").read_bytes() == secret_before  # never overwritten


def test_bad_key_folders_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="pagemesh keys"):
        curve.load_keys(str(tmp_path / "missing"))
    curve.make_keys(str(tmp_path / "a"))
    curve.make_keys(str(tmp_path / "b"))
    # a secret file whose public key is another pair's
    a, b = (tmp_path / "a" / "mesh.key_secret").read_text(), (tmp_path / "b" / "mesh.key").read_text()
    public_b = next(line for line in b.splitlines() if "public-key" in line)
    mixed = "\n".join(public_b if "public-key" in line else line for line in a.splitlines())
    (tmp_path / "a" / "mesh.key_secret").write_text(mixed)
    with pytest.raises(ValueError, match="not the secret key's"):
        curve.load_keys(str(tmp_path / "a"))
    # every command checks --zmq-keys before it starts anything
    done = subprocess.run(
        [*python_module("pagemesh.services.cli"), "--zmq-keys", str(tmp_path / "missing"), "scheduler"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 2 and "--zmq-keys" in done.stderr and "pagemesh keys" in done.stderr


def test_keyed_sockets_talk_in_both_directions(keyed, address):
    async def main():
        with t.Router(address) as router, t.Dealer(address, "w") as dealer:
            await dealer.send(READY)
            assert await router.recv() == (b"w", READY)
            await router.send(b"w", READY)
            assert await dealer.recv() == READY
        assert curve.gatekeeper().allowed == {keyed.public}

    run(main())


def rogue(address: str, server_key: bytes | None = None) -> zmq.Socket:
    """A raw DEALER that sends a valid message at once: without keys, or with keys of its own."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(address)
    sock.send_multipart(encode(Ready(service="rogue", name="rogue")))
    return sock


def test_rogues_without_keys_or_with_other_keys_get_nothing_through(keyed, address):
    async def main():
        with t.Router(address) as router:
            guard = curve.gatekeeper()
            refused = guard.refused
            rogues = [rogue(address), rogue(address, server_key=keyed.public)]
            try:
                # both are refused at the handshake (counted by the gatekeeper's thread) ...
                while guard.refused < refused + 2:
                    await asyncio.sleep(0.05)
                # ... and the keyed peer that connects after them is the first message received
                with t.Dealer(address, "w") as dealer:
                    await dealer.send(READY)
                    assert await router.recv() == (b"w", READY)
                assert router.dropped == 0  # nothing of theirs reached the decoder either
            finally:
                for sock in rogues:
                    sock.close()

    run(main())


def test_a_keyed_client_cannot_reach_a_server_without_keys(keys_dir, address, monkeypatch):
    """Keys on one side only is a misconfiguration that shows at once: nothing passes."""

    async def main():
        with t.Router(address) as router:  # no keys
            monkeypatch.setenv(curve.KEYS_ENV, keys_dir)
            with t.Dealer(address, "w") as dealer:
                await dealer.send(READY)
                # nothing to wait for here (over tcp one failed handshake, then silence): a second
                # bounds the look, and a message that got through would fail it at any load
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(router.recv(), 1.0)

    run(main())
