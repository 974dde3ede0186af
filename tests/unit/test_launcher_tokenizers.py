"""`pagemesh up --tokenizers N`: N tokenizer processes, each with its own sockets and name, and
one gateway that knows every one of them; the scheduler's --worker-return-wait passes through."""

from __future__ import annotations

import pytest

from pagemesh.common.transport import ipc_address
from pagemesh.gateway.config import parse_args as gateway_args
from pagemesh.services.launcher import parse, plan


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_replica_has_its_own_sockets_and_the_gateway_gets_them_all():
    procs = dict(plan(parse(["--mixed", "1", "--tokenizers", "3"]), "/tmp/pm"))
    names = [n for n, argv in procs.items() if argv[0] == "tokenizer"]
    assert names == ["tokenizer", "tokenizer-1", "tokenizer-2"]  # the first keeps the one-replica name
    addresses = [flag(procs[n], "--address") for n in names]
    outputs = {flag(procs[n], "--output-address") for n in names}
    assert addresses == [ipc_address("/tmp/pm", n) for n in names] and len(outputs) == 3
    assert [flag(procs[n], "--name") for n in names] == ["tokenizer-0", "tokenizer-1", "tokenizer-2"]
    gateway = gateway_args(procs["gateway"][1:])
    assert gateway.tokenizer_addresses == addresses


def test_one_replica_by_default_and_none_is_refused():
    procs = dict(plan(parse(["--mixed", "1"]), "/tmp/pm"))
    assert [n for n, argv in procs.items() if argv[0] == "tokenizer"] == ["tokenizer"]
    with pytest.raises(SystemExit):
        parse(["--mixed", "1", "--tokenizers", "0"])


def test_the_return_wait_reaches_the_scheduler():
    procs = dict(plan(parse(["--mixed", "1", "--worker-return-wait", "12.5"]), "/tmp/pm"))
    assert flag(procs["scheduler"], "--worker-return-wait") == "12.5"
    assert flag(dict(plan(parse(["--mixed", "1"]), "/tmp/pm"))["scheduler"], "--worker-return-wait") == "30.0"
