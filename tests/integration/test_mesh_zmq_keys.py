"""CurveZMQ on a whole mesh (issue 19): `pagemesh up --zmq-keys DIR` with the keys of `pagemesh
keys DIR`. A rogue peer that connects to the scheduler, the tokenizer, the gateway or the decode
worker's KV endpoint without keys, or with keys of its own, is refused at the handshake: its
valid messages get no answer, each process logs the refusal, nothing of it reaches a decoder; a
client with the mesh's keys is answered, and the mesh serves a completion after."""

from __future__ import annotations

import openai
import pytest
import zmq

from pagemesh.bench.local_mesh import HANG_S, running_mesh, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.common.protocol import ClusterStatus, StatusRequest, TokenDeltaBatch, decode, encode
from pagemesh.common.transport import ipc_address
from pagemesh.common.transport_curve import load_keys, make_keys
from pagemesh.tests.rogue_peers import connect, logged

pytestmark = pytest.mark.slow

NO_KEYS = "refused a peer: its handshake failed (no keys, or not CurveZMQ)"
OTHER_KEYS = "refused a peer: not the mesh's key"


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("zmq-keys") / "keys")
    make_keys(folder)
    return folder


@pytest.fixture(scope="module")
def mesh(keys_dir, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    output: list[str] = []
    # prefill and decode workers: the KV handoff runs keyed too (KV-sized frames over CurveZMQ)
    flags = ("--zmq-keys", keys_dir, "--run-dir", run_dir, "--log-format", "json")
    with running_mesh(*flags, output=output) as url:
        yield url, run_dir, output


def test_rogues_without_or_with_other_keys_get_nothing_through_and_the_mesh_serves(mesh, keys_dir):
    url, run_dir, output = mesh
    mesh_keys = load_keys(keys_dir)
    other_keys = zmq.curve_keypair()
    # every socket that binds in this mesh, by the process that binds it
    targets = [
        ("scheduler", "scheduler", zmq.DEALER, StatusRequest(requester="rogue")),
        ("tokenizer-0", "tokenizer", zmq.DEALER, StatusRequest(requester="rogue")),
        ("tokenizer-0", "tokenizer-out", zmq.PUSH, TokenDeltaBatch(worker_id="rogue", deltas=[])),
        ("gateway-0", "gateway-0", zmq.PUSH, TokenDeltaBatch(worker_id="rogue", deltas=[])),
        ("decode-0", "kv-decode-0", zmq.DEALER, StatusRequest(requester="rogue")),
    ]
    rogues = []
    for _, name, kind, msg in targets:
        address = ipc_address(run_dir, name)
        for keys in (None, other_keys):  # a valid message each: it would be decoded if it got in
            rogues.append(sock := connect(address, kind, keys=keys, server_key=mesh_keys.public))
            sock.send_multipart(encode(msg))
    try:
        for process in ("scheduler", "tokenizer-0", "gateway-0", "decode-0"):  # each refused both kinds and said so
            assert wait_until(lambda p=process: logged(output, p, NO_KEYS) and logged(output, p, OTHER_KEYS))
        # a client with the mesh's keys is answered where the rogues were not
        with connect(
            ipc_address(run_dir, "scheduler"),
            zmq.DEALER,
            keys=(mesh_keys.public, mesh_keys.secret),
            server_key=mesh_keys.public,
        ) as client:
            client.send_multipart(encode(StatusRequest(requester="keyed")))
            assert client.poll(HANG_S * 1000)
            assert isinstance(decode(client.recv_multipart()), ClusterStatus)
        assert [sock.poll(0) for sock in rogues if sock.type == zmq.DEALER] == [0] * 6
        assert not any("dropped malformed message" in line for line in output)  # nothing got to decode
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
        done = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Hello", max_tokens=3, temperature=0)
        assert done.usage.completion_tokens == 3  # through the keyed KV handoff too
    finally:
        for sock in rogues:
            sock.close()
