"""The gateway's operational routes and its API key (the real app over a real socket,
tests/gateway_harness.py): with `--metrics-require-key`, /metrics, /status and the status page
answer 401 in the API's error shape without the key or with a wrong one, and 200 with it; by
default they are open (a Prometheus scraper sends no key) while /v1 needs it. The probes stay
open either way. (The flag's parsing, and its refusal without keys: test_gateway_limits.py.)"""

from __future__ import annotations

from pagemesh.tests.gateway_harness import FakeMesh, run

KEYS = ("key-alpha", "key-beta")
OPERATIONAL = ("/metrics", "/status", "/")  # "/": the status page


async def assert_unauthorized(fake: FakeMesh, path: str, headers: dict[str, str]) -> None:
    response = await fake.client.get(path, headers=headers)
    assert response.status == 401, path
    error = (await response.json())["error"]  # the API's shape: what /v1 answers a missing or wrong key
    assert set(error) == {"message", "type", "param", "code"} and error["message"], path
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key"), path
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_metrics_and_status_need_the_key_when_the_flag_is_set(tmp_path):
    async def test(fake: FakeMesh):
        for path in OPERATIONAL:
            await assert_unauthorized(fake, path, {})
            await assert_unauthorized(fake, path, {"Authorization": "Bearer key-gamma"})
            response = await fake.client.get(path, headers={"Authorization": "Bearer key-beta"})
            assert response.status == 200, path
        metrics = await fake.client.get("/metrics", headers={"Authorization": "Bearer key-alpha"})
        assert "vllm:" in await metrics.text()  # the real exposition, not an empty page
        status = await fake.client.get("/status", headers={"Authorization": "Bearer key-alpha"})
        assert "workers" in await status.json()
        assert (await fake.client.get("/health")).status == 200  # probes stay open
        assert (await fake.client.get("/ready")).status != 401  # 503 here: the fake scheduler is silent

    run(tmp_path, test, api_keys=KEYS, metrics_require_key=True)


def test_metrics_and_status_are_open_by_default_while_v1_needs_the_key(tmp_path):
    async def test(fake: FakeMesh):
        for path in OPERATIONAL:
            assert (await fake.client.get(path)).status == 200, path
        await assert_unauthorized(fake, "/v1/models", {})

    run(tmp_path, test, api_keys=KEYS)
