"""Per-process CurveZMQ keys (`pagemesh keys DIR --process NAME...`, `--zmq-key-name NAME`): the
key files and the checks a process makes at start, then real sockets (ipc:// and tcp:// on
loopback, on a context of the test's own) whose binding side admits the allow-list's keys only: a
peer that presents another process's public key without its secret fails the handshake, a peer
with a valid pair not on the list and one with the mesh's own pair are refused, and none of them
gets a message to the receive loop, while a process on the list is served."""

from __future__ import annotations

import asyncio
import os
import socket
import stat

import pytest
import zmq
import zmq.asyncio
import zmq.auth

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common import transport as t
from pagemesh.common import transport_curve as curve
from pagemesh.common.protocol import Ready, encode
from pagemesh.services import cli, mesh_keys
from pagemesh.tests.rogue_peers import connect

NAMES = ("scheduler", "gateway")
READY = Ready(service="worker", name="w")


def make(folder: str, *argv: str) -> None:
    """`pagemesh keys FOLDER ARGV...`, in this process."""
    mesh_keys.main([folder, *argv])


@pytest.fixture
def keys_dir(tmp_path) -> str:
    folder = str(tmp_path / "keys")
    make(folder, "--process", *NAMES)
    return folder


@pytest.fixture
def clean_env(monkeypatch):
    """The key variables unset now, and as they were after the test whatever it set (cli.take_zmq_keys
    sets them): setenv records the value to restore, which delenv alone does not for an unset one."""
    for name in (curve.KEYS_ENV, curve.KEY_NAME_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def read(folder: str, name: str) -> bytes:
    with open(os.path.join(folder, name), "rb") as f:
        return f.read()


def public_of(path: str) -> bytes:
    public, secret = zmq.auth.load_certificate(path)
    assert secret is None, f"{path} holds a secret key"  # the allow-list holds public keys only
    return public


def test_keys_command_makes_a_pair_per_process_on_the_allow_list_and_never_overwrites(tmp_path, capsys):
    folder = str(tmp_path / "keys")
    make(folder, "--process", "scheduler", "--process", "gateway")
    assert "--zmq-key-name NAME" in capsys.readouterr().out
    assert sorted(os.listdir(folder)) == [
        "allowed",
        "gateway.key",
        "gateway.key_secret",
        "mesh.key",
        "mesh.key_secret",
        "scheduler.key",
        "scheduler.key_secret",
    ]
    assert sorted(os.listdir(os.path.join(folder, "allowed"))) == ["gateway.key", "scheduler.key"]
    for name in ("mesh", *NAMES):
        assert stat.S_IMODE(os.stat(os.path.join(folder, name + ".key_secret")).st_mode) == 0o600
    gateway = curve.load_keys(folder, "gateway")
    scheduler = curve.load_keys(folder, "scheduler")
    assert public_of(os.path.join(folder, "allowed", "gateway.key")) == gateway.client_public
    assert zmq.curve_public(gateway.client_secret) == gateway.client_public
    assert len({gateway.public, gateway.client_public, scheduler.client_public}) == 3  # three pairs
    # the binding sides admit the allow-list, not the mesh's pair (every binding process holds its secret)
    assert gateway.admitted == scheduler.admitted == {gateway.client_public, scheduler.client_public}
    assert gateway.public not in gateway.admitted

    files_before = {name: read(folder, name) for name in os.listdir(folder) if name != "allowed"}
    with pytest.raises(SystemExit) as refused:  # one name that has keys: nothing is written, not even the new one
        make(folder, "--process", "worker-0", "gateway")
    assert refused.value.code == 1 and "exists" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(folder, "worker-0.key"))
    for bad in ("mesh", "../escape", ".hidden", "a/b", ""):
        with pytest.raises(SystemExit):
            make(folder, "--process", bad)
        assert "key name" in capsys.readouterr().err
    make(folder, "--process", "worker-0")  # a process added later: the others' keys are kept
    assert {name: read(folder, name) for name in files_before} == files_before
    worker = curve.load_keys(folder, "worker-0")
    assert worker.admitted == gateway.admitted | {worker.client_public}
    assert not os.path.exists(tmp_path / "escape.key")


def test_the_shared_pair_alone_admits_the_mesh_key_as_before(tmp_path):
    folder = str(tmp_path / "keys")
    make(folder)
    keys = curve.load_keys(folder)
    assert not os.path.exists(os.path.join(folder, "allowed"))
    assert (keys.name, keys.client_public, keys.client_secret) == ("mesh", keys.public, keys.secret)
    assert keys.admitted == {keys.public}
    curve.check_admitted(keys)  # a process without a name starts


def test_a_process_starts_only_with_its_own_key_on_the_allow_list(keys_dir, clean_env, capsys):
    def start(*argv: str) -> str:
        with pytest.raises(SystemExit) as stopped:
            cli.take_zmq_keys([*argv, "scheduler"])
        assert stopped.value.code == 2
        return capsys.readouterr().err

    assert cli.take_zmq_keys(["--zmq-keys", keys_dir, "--zmq-key-name", "gateway", "scheduler"]) == ["scheduler"]
    assert os.environ[curve.KEY_NAME_ENV] == "gateway"
    clean_env.delenv(curve.KEY_NAME_ENV)
    assert "--zmq-key-name NAME" in start("--zmq-keys", keys_dir)  # the mesh's pair is not on the list
    assert "--process nobody" in start("--zmq-keys", keys_dir, "--zmq-key-name", "nobody")  # no such pair
    os.remove(os.path.join(keys_dir, "allowed", "gateway.key"))  # the gateway taken off the list
    assert "not on the allow-list" in start("--zmq-keys", keys_dir, "--zmq-key-name", "gateway")
    clean_env.delenv(curve.KEYS_ENV)
    assert "needs --zmq-keys" in start("--zmq-key-name", "scheduler")
    # `pagemesh keys` itself checks nothing: it makes them
    assert cli.take_zmq_keys(["--zmq-keys", keys_dir, "keys", keys_dir, "--process", "x"]) == [
        "keys",
        keys_dir,
        "--process",
        "x",
    ]


def test_key_names_are_file_names(tmp_path):
    for good in ("scheduler", "tokenizer-0", "decode_1", "gateway.eu"):
        assert curve.check_key_name(good) == good
    for bad in ("mesh", "", ".x", "a/b", "../x", "a b", "x" * 65):
        with pytest.raises(ValueError, match="key name"):
            curve.check_key_name(bad)
    os.makedirs(tmp_path / "allowed")
    (tmp_path / "allowed" / "broken.key").write_text("not a certificate\n")
    with pytest.raises(ValueError, match="allowed"):
        curve.allow_list(str(tmp_path))


@pytest.fixture(params=["ipc", "tcp"])
def address(request, tmp_path):
    if request.param == "ipc":
        return t.ipc_address(str(tmp_path), "sock")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return t.tcp_address("127.0.0.1", s.getsockname()[1])


def test_a_process_on_the_allow_list_is_served_and_forged_or_unlisted_keys_are_refused(keys_dir, address, clean_env):
    mesh = curve.load_keys(keys_dir)
    gateway_public = curve.load_keys(keys_dir, "gateway").client_public
    made_up_secret = zmq.curve_keypair()[1]
    # the test's own context: its gatekeeper admits this folder's keys only, and goes with it
    context = zmq.asyncio.Context()

    async def refused(router: t.Router, guard: curve.Gatekeeper, kind: str, count: int) -> None:
        """Until the gatekeeper's thread counted `count` refusals of `kind` (a hang is bounded by
        asyncio.run's wait_for); fails at once if the router receives anything meanwhile."""
        arrival = asyncio.ensure_future(router.recv())
        try:
            while guard.refusals[kind] < count:
                assert not arrival.done(), f"a rogue's message got through: {arrival.result()}"
                await asyncio.sleep(0.02)
        finally:
            arrival.cancel()

    async def main():
        clean_env.setenv(curve.KEYS_ENV, keys_dir)
        clean_env.setenv(curve.KEY_NAME_ENV, "scheduler")
        with t.Router(address, context=context) as router:
            guard = curve.gatekeeper(context)
            assert guard.allowed == mesh.admitted
            rogues = []
            try:
                # another process's public key without its secret: the handshake fails (before ZAP)
                forged = (gateway_public, made_up_secret)
                rogues.append(connect(address, zmq.DEALER, keys=forged, server_key=mesh.public))
                rogues[-1].send_multipart(encode(Ready(service="rogue", name="forged")))
                await refused(router, guard, curve.FORGED_KEY, 1)
                # a valid pair that is not on the list, and the mesh's own pair: refused by ZAP
                for keys in (zmq.curve_keypair(), (mesh.public, mesh.secret)):
                    rogues.append(connect(address, zmq.DEALER, keys=keys, server_key=mesh.public))
                    rogues[-1].send_multipart(encode(Ready(service="rogue", name="unlisted")))
                await refused(router, guard, curve.NOT_ADMITTED, 2)
                # the gateway's real pair is on the list: its message is the first the router receives
                clean_env.setenv(curve.KEY_NAME_ENV, "gateway")
                with t.Dealer(address, "w", context=context) as dealer:
                    await dealer.send(READY)
                    assert await asyncio.wait_for(router.recv(), HANG_S) == (b"w", READY)
                    await router.send(b"w", READY)
                    assert await asyncio.wait_for(dealer.recv(), HANG_S) == READY
                assert router.dropped == 0  # nothing of the rogues' reached the decoder either
                assert [sock.poll(0) for sock in rogues] == [0, 0, 0]
            finally:
                for sock in rogues:
                    sock.close()

    try:
        asyncio.run(asyncio.wait_for(main(), HANG_S))
    finally:
        curve.stop_gatekeepers(context)
        context.destroy(linger=0)
