"""How often a model's tool calls are usable: 50 requests that each call for one of five tools (all
five offered every time), answered with tool_choice "auto" (the model writes calls its own way,
the Hermes parser reads them) and with "required" (the grammar holds the answer to a list of
calls valid against the tools' schemas), one call per answer (parallel_tool_calls false).

    python bench/tool_calls.py                      # starts `pagemesh up --mixed 1` with the Hermes template
    python bench/tool_calls.py --url http://127.0.0.1:8000 --temperature 0.7

For each mode, over the answers: how many hold a tool call, how many calls parse (a tool's name,
arguments that are a JSON object), how many are valid (the arguments validate against the tool's
`parameters` with jsonschema), how many name the tool the request was about; for "auto", how many
answers wrote `<tool_call>` that did not parse. A started mesh serves the default model with
docs/chat_templates/chatml_tools_hermes.jinja, --enable-auto-tool-choice --tool-call-parser hermes.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "docs" / "chat_templates" / "chatml_tools_hermes.jinja"


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


STRING, NUMBER = {"type": "string"}, {"type": "number"}
TOOLS = [
    _function(
        "get_weather",
        "The current weather in a city",
        {"city": STRING, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city", "unit"],
    ),
    _function(
        "convert_currency",
        "Convert an amount of money from one currency to another",
        {"amount": NUMBER, "from_currency": STRING, "to_currency": STRING},
        ["amount", "from_currency", "to_currency"],
    ),
    _function("get_time", "The current local time in a time zone", {"timezone": STRING}, ["timezone"]),
    _function(
        "send_email",
        "Send an email",
        {"to": STRING, "subject": STRING, "body": STRING},
        ["to", "subject", "body"],
    ),
    _function("search_web", "Search the web", {"query": STRING, "max_results": {"type": "integer"}}, ["query"]),
]
PROMPTS = {
    "get_weather": [
        "What's the weather in Paris?",
        "Is it raining in London right now?",
        "How hot is it in Cairo today, in celsius?",
        "Tell me the temperature in New York in fahrenheit.",
        "Do I need an umbrella in Tokyo today?",
        "What is the weather like in Sydney?",
        "Check the weather in Berlin for me.",
        "Is it snowing in Oslo?",
        "How cold is it in Moscow at the moment?",
        "What's the forecast for Rome today?",
    ],
    "convert_currency": [
        "Convert 100 US dollars to euros.",
        "How many yen is 50 euros?",
        "What is 250 British pounds in US dollars?",
        "Change 1000 Swiss francs into euros.",
        "How much is 75 Canadian dollars in Mexican pesos?",
        "Convert 20 euros to Indian rupees.",
        "I have 500 Australian dollars, how many US dollars is that?",
        "What are 300 Chinese yuan worth in euros?",
        "Convert 12.5 dollars to pounds.",
        "How many Swedish kronor do I get for 40 euros?",
    ],
    "get_time": [
        "What time is it in Tokyo?",
        "Tell me the current time in Europe/London.",
        "What's the local time in New York?",
        "What time is it now in Sydney, Australia?",
        "Give me the time in the America/Los_Angeles time zone.",
        "Is it morning or evening in Mumbai right now?",
        "What is the current time in UTC?",
        "What time is it in Berlin?",
        "Current time in Asia/Singapore, please.",
        "What's the hour in Buenos Aires now?",
    ],
    "send_email": [
        "Send an email to alice@example.com saying the meeting moved to 3pm.",
        "Email bob@example.com with the subject 'Invoice' and tell him it is paid.",
        "Write to carol@example.com that I will be late tomorrow.",
        "Send dave@example.com a thank-you note for the gift.",
        "Email the team at team@example.com that the release is done.",
        "Let eve@example.com know by email that the report is attached.",
        "Send an email to frank@example.com asking for the slides.",
        "Email grace@example.com: lunch on Friday?",
        "Notify heidi@example.com by email that her order shipped.",
        "Send ivan@example.com an email reminding him of the deadline.",
    ],
    "search_web": [
        "Search the web for the tallest building in the world.",
        "Find recent news about electric cars.",
        "Look up who won the 2018 World Cup.",
        "Search for a recipe for banana bread.",
        "Find the population of Canada online.",
        "Search the web for the best hiking trails in Colorado, 5 results.",
        "Look up the opening hours of the Louvre.",
        "Find articles about paged attention in LLM serving.",
        "Search for the boiling point of ethanol.",
        "Look up reviews of the latest smartphone, 3 results.",
    ],
}
MODES = ("auto", "required")


@dataclass
class Tally:
    answers: int = 0
    with_call: int = 0
    parsed: int = 0
    valid: int = 0
    right_tool: int = 0
    unparsed_tags: int = 0  # auto: answers that wrote <tool_call> but gave no call
    cut_off: int = 0  # answers that ended at max_tokens
    seconds: float = 0.0
    failures: list = field(default_factory=list)  # (prompt, message) of the answers with no valid call


def judge(message: dict, finish_reason: str, expected: str, tally: Tally) -> bool:
    """Count one answer by its first call (one per answer is asked for); True if it is valid."""
    import jsonschema

    tally.answers += 1
    tally.cut_off += finish_reason == "length"
    calls = message.get("tool_calls") or []
    if not calls:
        tally.unparsed_tags += "<tool_call>" in (message.get("content") or "")
        return False
    tally.with_call += 1
    function = calls[0]["function"]
    tool = next((t["function"] for t in TOOLS if t["function"]["name"] == function["name"]), None)
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return False
    if tool is None or not isinstance(arguments, dict):
        return False
    tally.parsed += 1
    try:
        jsonschema.validate(arguments, tool["parameters"])
    except jsonschema.ValidationError:
        return False
    tally.valid += 1
    tally.right_tool += function["name"] == expected
    return True


def run_mode(url: str, mode: str, args: argparse.Namespace) -> Tally:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    prompts = [(tool, text) for tool, texts in PROMPTS.items() for text in texts][: args.prompts]

    def ask(item: tuple[str, str]) -> tuple[tuple[str, str], dict, str]:
        answer = client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": item[1]}],
            tools=TOOLS,
            tool_choice=mode,
            parallel_tool_calls=False,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
        )
        return item, answer.choices[0].message.model_dump(exclude_none=True), answer.choices[0].finish_reason

    tally = Tally()
    started = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for (expected, prompt), message, finish_reason in pool.map(ask, prompts):
            if not judge(message, finish_reason, expected, tally):
                tally.failures.append((prompt, finish_reason, message))
    tally.seconds = time.monotonic() - started
    return tally


def report(tallies: dict[str, Tally], args: argparse.Namespace) -> str:
    lines = [
        f"tool-call validity, {args.prompts} prompts, 5 tools offered, one call per answer, "
        f"max_tokens {args.max_tokens}, temperature {args.temperature}",
        "| tool_choice | answers | with a call | parse | valid (schema) | right tool | tag unparsed | cut off | s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, t in tallies.items():
        share = lambda k: f"{k} ({k / max(t.answers, 1):.0%})"  # noqa: E731
        grammar = " (grammar)" if mode == "required" else " (hermes parser)"
        lines.append(
            f"| {mode}{grammar} | {t.answers} | {share(t.with_call)} | {share(t.parsed)} | {share(t.valid)} | "
            f"{share(t.right_tool)} | {t.unparsed_tags if mode == 'auto' else '-'} | {t.cut_off} | {t.seconds:.0f} |"
        )
    for mode, t in tallies.items():
        for prompt, finish_reason, message in t.failures[: args.show]:
            lines.append(f"{mode} {finish_reason}: {prompt!r} -> {json.dumps(message, ensure_ascii=False)[:300]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running pagemesh gateway (default: start a mesh)")
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES), help="auto,required")
    parser.add_argument("--show", type=int, default=0, help="print this many answers with no valid call per mode")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if args.url:
        tallies = {mode: run_mode(args.url, mode, args) for mode in modes}
    else:
        from pagemesh.bench.local_mesh import running_mesh

        flags = ["--mixed", "1", "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice"]
        with running_mesh(*flags, "--tool-call-parser", "hermes") as url:
            tallies = {mode: run_mode(url, mode, args) for mode in modes}
    print(report(tallies, args))


if __name__ == "__main__":
    main()
