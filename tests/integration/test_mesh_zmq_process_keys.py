"""Per-process CurveZMQ keys on a whole mesh: the processes `pagemesh up` would start, started one
by one (as compose starts them), each with its own pair (`pagemesh keys DIR --process NAME...`,
then PAGEMESH_ZMQ_KEY_NAME=NAME) and only their keys on the allow-list (the mesh's shared pair is
not on it: a process that presented it would be refused, so serving at all shows each used its
own). The mesh serves a chat completion; a rogue that presents the decode worker's public key
with a made-up secret, and one with a valid pair that is not on the allow-list, each try to
register a worker with the scheduler: the scheduler logs both refusals, neither worker is in the
mesh, neither rogue gets an answer, and nothing of theirs reaches a decoder."""

from __future__ import annotations

import openai
import pytest
import zmq
import zmq.asyncio

from pagemesh.bench.local_mesh import HANG_S, SeparateProcesses, wait_until
from pagemesh.common.logging import FORMAT_ENV
from pagemesh.common.messages.base import WorkerKind, WorkerRole
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.common.protocol import ClusterStatus, KVPoolInfo, RegisterWorker, StatusRequest, decode, encode
from pagemesh.common.transport import ipc_address
from pagemesh.common.transport_curve import (
    FORGED_KEY,
    KEY_NAME_ENV,
    KEYS_ENV,
    NOT_ADMITTED,
    load_keys,
    make_process_keys,
    stop_gatekeepers,
)
from pagemesh.services.log_relay import LogRelay
from pagemesh.services.supervisor import Supervisor
from pagemesh.tests.rogue_peers import connect, logged

pytestmark = pytest.mark.slow

# this test's own key, on the allow-list: it asks the scheduler for its status, and binds the
# socket the children report READY to (what `pagemesh up` binds)
PROBE = "probe"


class LinesOut:
    """A LogRelay's `out` that keeps the children's log lines for the test to read."""

    def __init__(self):
        self.lines: list[str] = []

    def write(self, data: bytes) -> None:
        self.lines.append(data.decode("utf-8", "replace"))

    def flush(self) -> None:
        pass


class OwnKeySupervisor(Supervisor):
    """Starts every child with its own key: PAGEMESH_ZMQ_KEY_NAME is the child's name."""

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        super().spawn(name, argv, {**(env or {}), KEY_NAME_ENV: name})


@pytest.fixture(scope="module")
def keyed_mesh(tmp_path_factory):
    keys_dir = str(tmp_path_factory.mktemp("zmq-keys") / "keys")
    run_dir = str(tmp_path_factory.mktemp("run"))
    processes = SeparateProcesses(run_dir)
    make_process_keys(keys_dir, [*processes.argv, PROBE])  # scheduler, tokenizer, prefill-0, decode-0, gateway
    output = LinesOut()
    json_logs = {**processes.mesh.supervisor.env, FORMAT_ENV: "json"}
    processes.mesh.supervisor = OwnKeySupervisor(processes.children, relay=LogRelay(out=output), env=json_logs)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(KEYS_ENV, keys_dir)  # the children's folder (they inherit it), and this process's
        env.setenv(KEY_NAME_ENV, PROBE)
        try:
            with processes:
                yield processes, keys_dir, output.lines
        finally:
            # this process's gatekeeper admits this folder's keys: it goes with it, not into later tests
            stop_gatekeepers(zmq.asyncio.Context.instance())


def register(worker_id: str, model: str) -> list[bytes]:
    """What a worker sends the scheduler first: a valid message, decoded and acted on if it got in."""
    kv = KVPoolInfo(page_size=16, num_pages=64, kv_endpoint="")
    msg = RegisterWorker(
        worker_id=worker_id,
        kind=WorkerKind.LLM,
        role=WorkerRole.MIXED,
        model=model,
        max_running=8,
        kv=kv,
        instance=worker_id,
    )
    return encode(msg)


def test_a_mesh_of_own_keys_serves_and_refuses_a_forged_or_unlisted_key(keyed_mesh):
    processes, keys_dir, output = keyed_mesh
    probe = load_keys(keys_dir, PROBE)
    scheduler = ipc_address(processes.mesh.run_dir, "scheduler")
    workers = {name for name, argv in processes.argv.items() if argv[0] == "worker"}

    def worker_ids() -> set[str]:
        """The workers the scheduler knows, asked with the probe's own pair."""
        with connect(
            scheduler, zmq.DEALER, keys=(probe.client_public, probe.client_secret), server_key=probe.public
        ) as client:
            client.send_multipart(encode(StatusRequest(requester=PROBE)))
            assert client.poll(HANG_S * 1000)
            status = decode(client.recv_multipart())
            assert isinstance(status, ClusterStatus)
            return {w.worker_id for w in status.workers}

    assert worker_ids() == workers == {"prefill-0", "decode-0"}
    decode_public = load_keys(keys_dir, "decode-0").client_public
    forged = connect(scheduler, zmq.DEALER, keys=(decode_public, zmq.curve_keypair()[1]), server_key=probe.public)
    unlisted = connect(scheduler, zmq.DEALER, keys=zmq.curve_keypair(), server_key=probe.public)
    try:
        forged.send_multipart(register("rogue-forged", DEFAULT_MODEL_NAME))
        unlisted.send_multipart(register("rogue-unlisted", DEFAULT_MODEL_NAME))

        def refused_both() -> bool:
            return bool(logged(output, "scheduler", FORGED_KEY) and logged(output, "scheduler", NOT_ADMITTED))

        # until the scheduler said it refused both, or (a failure, seen at once) a rogue worker is in
        assert wait_until(lambda: refused_both() or worker_ids() != workers, interval=0.5)
        assert worker_ids() == workers  # neither rogue registered
        assert refused_both()
        assert [forged.poll(0), unlisted.poll(0)] == [0, 0]  # no Registered came back
        assert not any("dropped malformed message" in line for line in output)  # nothing got to decode

        client = openai.OpenAI(base_url=processes.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
        chat = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=3,
            temperature=0,
        )
        assert chat.usage.completion_tokens == 3  # through every keyed hop, the KV handoff included
    finally:
        forged.close()
        unlisted.close()
