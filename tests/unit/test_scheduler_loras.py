"""MeshAdapters (services/scheduler/loras.py): one load or unload over every LLM worker, answered
once all have done it, undone where it succeeded when it failed anywhere; workers synced from
their heartbeats."""

from pagemesh.common.messages import LoRAAdapterDone, LoRAAdapterReply, LoRAAdapterRequest, LoRAAdapterTask, LoRAOp
from pagemesh.services.scheduler.loras import MeshAdapters

GATEWAY = b"gateway-0"


def load(name: str, path: str = "/a", op_id: str = "op") -> LoRAAdapterRequest:
    return LoRAAdapterRequest(requester="gateway-0", op_id=op_id, op=LoRAOp.LOAD, name=name, path=path)


def done(worker: str, status: int = 200, message: str = "", op_id: str = "op") -> LoRAAdapterDone:
    return LoRAAdapterDone(worker_id=worker, op_id=op_id, status=status, message=message)


def test_a_load_goes_to_every_worker_and_is_listed_once_all_have_it():
    mesh = MeshAdapters()
    out = mesh.request(GATEWAY, load("sql"), ["w1", "w2"])
    task = LoRAAdapterTask(op_id="op", op=LoRAOp.LOAD, name="sql", path="/a")
    assert out == [("w1", task), ("w2", task)]
    assert mesh.done(done("w1")) == [] and not mesh.serves("sql")
    reply = LoRAAdapterReply(op_id="op", status=200, message="Success: LoRA adapter 'sql' added successfully.")
    assert mesh.done(done("w2")) == [(GATEWAY, reply)]
    assert mesh.serves("sql") and [a.name for a in mesh.listed()] == ["sql"]
    again = mesh.request(GATEWAY, load("sql", op_id="op2"), ["w1"])
    assert again[0][1].status == 400 and "already been loaded" in again[0][1].message


def test_a_load_that_fails_on_one_worker_is_undone_on_the_others_and_not_listed():
    mesh = MeshAdapters()
    mesh.request(GATEWAY, load("sql"), ["w1", "w2"])
    mesh.done(done("w1"))
    out = mesh.done(done("w2", 400, "lora: rank 64 of q_proj is above --max-lora-rank 16"))
    (undo_worker, undo), (to, reply) = out
    assert undo_worker == "w1" and undo.op is LoRAOp.UNLOAD and undo.name == "sql"
    assert to == GATEWAY and (reply.status, reply.message) == (
        400,
        "lora: rank 64 of q_proj is above --max-lora-rank 16",
    )
    assert not mesh.serves("sql")
    assert mesh.done(done("w1", op_id=undo.op_id)) == []  # the undo answers nobody


def test_a_worker_lost_mid_operation_counts_as_answered_and_unknown_names_are_404():
    mesh = MeshAdapters((("chat", "/c"),))
    mesh.request(GATEWAY, load("sql"), ["w1", "w2"])
    mesh.done(done("w1"))
    ((to, reply),) = mesh.worker_gone("w2")
    assert reply.status == 200 and mesh.serves("sql")
    unload = LoRAAdapterRequest(requester="g", op_id="u", op=LoRAOp.UNLOAD, name="nope")
    assert mesh.request(GATEWAY, unload, ["w1"])[0][1].status == 404
    assert mesh.request(GATEWAY, load("x", op_id="n"), [])[0][1].status == 503


def test_heartbeats_bring_a_worker_to_the_meshs_list():
    mesh = MeshAdapters((("chat", "/c"), ("sql", "/s")))
    out = mesh.sync("w3", ["sql", "old"])  # a new or restarted worker
    assert [(w, m.op, m.name) for w, m in out] == [("w3", LoRAOp.LOAD, "chat"), ("w3", LoRAOp.UNLOAD, "old")]
    assert mesh.sync("w3", ["sql", "old"]) == []  # operations under way: not sent twice
