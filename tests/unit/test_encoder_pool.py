"""Which encoder worker gets an image prompt's images, and what the prompt's task says of it
(services/scheduler/tasks.py `with_encoder`; issue 32's --encoder N). Pure logic."""

from __future__ import annotations

from pagemesh.common.messages import EncodeTask, GenerateTask, ImageInput, ScheduleRequest, WorkerKind, WorkerRole
from pagemesh.common.sampling import SamplingParams
from pagemesh.services.scheduler.registry import WorkerInfo
from pagemesh.services.scheduler.tasks import with_encoder

PROMPT = [5, 9, 9, 6]
IMAGE = ImageInput(digest="a" * 64, offset=1, length=2, data=b"png", grid=[])


def worker(wid: str, kind=WorkerKind.LLM, embeds="", waiting=0) -> WorkerInfo:
    info = WorkerInfo(wid, kind, WorkerRole.MIXED, "m", 8, 0.0, waiting=waiting)
    info.embeds_endpoint = embeds
    return info


def task() -> GenerateTask:
    return GenerateTask(
        request_id="r", prompt_token_ids=[5, 9, 9, 6], sampling=SamplingParams(), reply_to="t", images=[IMAGE]
    )


def test_the_least_loaded_encoder_gets_the_images_and_the_prompt_waits_for_it():

    req = ScheduleRequest(
        request_id="r",
        prompt_token_ids=[5, 9, 9, 6],
        sampling=SamplingParams(),
        reply_to="t",
        arrival_time=0.0,
        images=[IMAGE],
    )
    llm = worker("mixed-0", embeds="ipc:///run/embeds-mixed-0")
    busy, idle = worker("enc-0", WorkerKind.ENCODER, waiting=3), worker("enc-1", WorkerKind.ENCODER)
    out = with_encoder(req, [("mixed-0", task())], [busy, idle], {"mixed-0": llm})
    (encoder_id, encode), (prompt_id, prompt_task) = out
    assert encoder_id == "enc-1" and isinstance(encode, EncodeTask)
    assert (encode.images, encode.target_worker_id, encode.target_endpoint) == ([IMAGE], "mixed-0", llm.embeds_endpoint)
    assert (prompt_id, prompt_task.encoder_id) == ("mixed-0", "enc-1")
    assert idle.waiting == 1  # counted until its next heartbeat
    # no encoder, or a worker that takes no rows: the prompt's worker encodes
    assert with_encoder(req, [("mixed-0", task())], [], {"mixed-0": llm}) == [("mixed-0", task())]
    plain = worker("mixed-0")
    assert with_encoder(req, [("mixed-0", task())], [idle], {"mixed-0": plain}) == [("mixed-0", task())]
