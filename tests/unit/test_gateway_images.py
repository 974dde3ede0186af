"""The images route's field checks: each bad field is a 400 naming it; defaults stay None for
the model to fill; the response has OpenAI's shape."""

from __future__ import annotations

import pytest

from pagemesh.common.messages import ImageParams, ImageResult
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.images import MAX_PROMPT_CHARS, image_response, parse_image_request


def test_a_minimal_request_leaves_every_choice_to_the_model():
    model, params = parse_image_request({"prompt": "a handwritten 3"})
    assert model is None
    assert params == ImageParams(
        prompt="a handwritten 3",
        negative_prompt=None,
        n=1,
        width=None,
        height=None,
        num_inference_steps=None,
        guidance_scale=None,
        sampler=None,
        seed=None,
    )


def test_openai_fields_and_the_extras_vllm_and_sglang_users_pass():
    model, params = parse_image_request(
        {
            "prompt": "the digit seven",
            "model": "digits-dit",
            "n": 4,
            "size": "128x64",
            "response_format": "b64_json",
            "user": "u1",
            "quality": "standard",  # OpenAI fields this server has no use for are ignored
            "seed": 42,
            "num_inference_steps": 20,
            "guidance_scale": 3,
            "negative_prompt": "1",
            "sampler": "dpmsolver++",
            "cache": "fbcache:0.08",
        }
    )
    assert model == "digits-dit"
    assert (params.n, params.width, params.height, params.seed) == (4, 128, 64, 42)
    assert (params.num_inference_steps, params.guidance_scale, params.sampler) == (20, 3.0, "dpmsolver++")
    assert params.negative_prompt == "1" and params.cache == "fbcache:0.08"
    assert parse_image_request({"prompt": "7", "size": "auto"})[1].width is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": 7}, "prompt"),
        ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
        ({"prompt": "7", "negative_prompt": ""}, "negative_prompt"),
        ({"prompt": "7", "n": 0}, "n"),
        ({"prompt": "7", "n": 11}, "n"),
        ({"prompt": "7", "n": True}, "n"),
        ({"prompt": "7", "n": 2.0}, "n"),
        ({"prompt": "7", "size": "256"}, "size"),
        ({"prompt": "7", "size": "0x8"}, "size"),
        ({"prompt": "7", "size": "8192x8192"}, "size"),
        ({"prompt": "7", "response_format": "url"}, "response_format"),
        ({"prompt": "7", "output_format": "jpeg"}, "output_format"),
        ({"prompt": "7", "sampler": "heun"}, "sampler"),
        ({"prompt": "7", "num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": "7", "num_inference_steps": "10"}, "num_inference_steps"),
        ({"prompt": "7", "guidance_scale": -1}, "guidance_scale"),
        ({"prompt": "7", "guidance_scale": "high"}, "guidance_scale"),
        ({"prompt": "7", "seed": -1}, "seed"),
        ({"prompt": "7", "model": ""}, "model"),
        ({"prompt": "7", "user": 5}, "user"),
        ({"prompt": "7", "cache": 3}, "cache"),
        ({"prompt": "7", "cache": ""}, "cache"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(body, param):
    with pytest.raises(ApiError) as e:
        parse_image_request(body)
    assert (e.value.status, e.value.type, e.value.param) == (400, "invalid_request_error", param)
    assert e.value.message.startswith(f"{param}:")


def test_the_response_is_openais_images_response_with_what_was_done_in_usage():
    result = ImageResult(
        request_id="img-1",
        images=["AAA=", "BBB="],
        width=256,
        height=256,
        native_width=8,
        native_height=8,
        steps=20,
        sampler="ddim",
        seed=9,
        queued_s=0.01,
        compute_s=0.5,
        batched_with=3,
    )
    body = image_response(result, created=1700000000)
    assert body["created"] == 1700000000
    assert body["data"] == [{"b64_json": "AAA="}, {"b64_json": "BBB="}]
    assert body["size"] == "256x256" and body["output_format"] == "png"
    usage = body["usage"]
    assert (usage["num_inference_steps"], usage["sampler"], usage["seed"]) == (20, "ddim", 9)
    assert usage["native_size"] == "8x8"
    assert usage["batched_with"] == 3 and usage["images"] == 2


def test_usage_says_which_cache_ran_and_the_blocks_it_computed_and_skipped():
    result = ImageResult(
        request_id="img-2",
        images=["AAA="],
        width=8,
        height=8,
        native_width=8,
        native_height=8,
        steps=25,
        sampler="dpmsolver++",
        seed=1,
        queued_s=0.0,
        compute_s=0.2,
        batched_with=0,
        cache="fbcache:0.08",
        blocks_computed=120,
        blocks_skipped=80,
    )
    usage = image_response(result, created=1)["usage"]
    assert (usage["cache"], usage["cache_over_budget"]) == ("fbcache:0.08", False)
    assert (usage["blocks_computed"], usage["blocks_skipped"]) == (120, 80)
