"""A gateway whose pings stop: the tokenizer forgets its requests (to abort them at the scheduler),
and only its own; a gateway that pings on keeps its requests."""

from pagemesh.services.tokenizer.gateway_liveness import GatewayLiveness
from pagemesh.tests.unit.test_tokenizer_service import GATEWAY_A, GATEWAY_B, core, request


def test_only_a_gateway_whose_pings_stopped_for_the_timeout_is_gone():
    liveness = GatewayLiveness(timeout_s=15.0)
    liveness.seen(GATEWAY_A, now=100.0)
    liveness.seen(GATEWAY_B, now=100.0)
    assert liveness.gone(now=114.0) == []
    liveness.seen(GATEWAY_B, now=114.0)  # B pings on, A stopped at 100
    assert liveness.gone(now=115.5) == [GATEWAY_A]
    assert liveness.gone(now=116.0) == []  # said once
    liveness.seen(GATEWAY_A, now=120.0)  # back (restarted at the same address)
    assert liveness.gone(now=125.0) == []


def test_dropping_a_gateway_forgets_its_requests_and_no_other():
    c = core()
    for rid, gateway in (("a1", GATEWAY_A), ("b1", GATEWAY_B), ("a2", GATEWAY_A)):
        c.admit(request(rid, reply_to=gateway))
    assert sorted(c.drop_gateway(GATEWAY_A)) == ["a1", "a2"]
    assert "a1" not in c and "a2" not in c and "b1" in c
    assert c.drop_gateway(GATEWAY_A) == []
