"""TensorZero side of bench/peers (run by bench/peers/run inside target/peers/venv).

TensorZero's gateway runs embedded in this process (PyPI `tensorzero`, the Rust gateway in a
native module; `AsyncTensorZeroGateway.build_embedded(config_file=..., async_setup=False)`,
tensorzero.com/docs/gateway/clients "Embedded Gateway"), with one model whose provider is
`type = "openai"` and `api_base` = the `turnstile sim` OpenAI-compatible endpoint
(tensorzero.com/docs/integrations/model-providers/openai-compatible; `api_key_location =
"none"`), observability off (no ClickHouse/Postgres: nothing is stored).

- gateway: closed loop, `--concurrency` tasks calling `await client.inference(model_name=...,
  input={"messages": [{"role": "user", "content": "Hello?"}]})`, `--requests` per run; each
  run's figure is elapsed / completed requests (the inverse of throughput), as for
  `turnstile-peerbench load`. There is no HTTP hop between client and gateway here (it is
  in-process), which favours TensorZero against the HTTP gateways.
- probe: the five bad histories in TensorZero's own input format (tool calls in assistant
  messages, tool results in user messages, `additional_tools`), then what reached the
  simulator (`GET /sim/requests`, body byte for byte) or the exception; and a streamed reply
  the simulator cuts inside the second call's arguments (`disconnect_after_events`): which
  chunks arrived and whether an error was raised.
"""

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, probe_line  # noqa: E402

import tensorzero  # noqa: E402
from tensorzero import AsyncTensorZeroGateway, TensorZeroGateway  # noqa: E402

CONFIG = """
[gateway.observability]
enabled = false

[models.{name}]
routing = ["sim"]

[models.{name}.providers.sim]
type = "openai"
api_base = "{sim}/v1/"
model_name = "{name}"
api_key_location = "none"
"""


def write_config(path, sim):
    text = "".join(CONFIG.format(name=name, sim=sim) for name in ("bench", "probe", "probe_cut"))
    # One [gateway.observability] table only.
    first, rest = text.split("[models.bench]", 1)
    rest = rest.replace("[gateway.observability]\nenabled = false\n", "")
    with open(path, "w") as handle:
        handle.write(first + "[models.bench]" + rest)


def http(method, url, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        raw = response.read()
        return json.loads(raw) if raw else None


async def gateway(args):
    client = await AsyncTensorZeroGateway.build_embedded(config_file=args.config, async_setup=True)
    message = {"messages": [{"role": "user", "content": "Hello?"}]}

    async def one():
        response = await client.inference(model_name="bench", input=message, params={"chat_completion": {"max_tokens": 256}})
        if not response.content or not getattr(response.content[0], "text", None):
            raise RuntimeError(f"unexpected reply: {response}")

    for _ in range(8):
        await one()
    samples, p50s, p99s = [], [], []
    errors = 0
    for run in range(args.runs):
        latencies = []
        counter = iter(range(args.requests))

        async def worker():
            nonlocal errors
            for _ in counter:
                begun = time.perf_counter()
                try:
                    await one()
                    latencies.append(time.perf_counter() - begun)
                except Exception as error:  # noqa: BLE001
                    if errors == 0:
                        print(f"tensorzero: request failed: {error}", file=sys.stderr)
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
        latencies.sort()
        ok = len(latencies)
        samples.append(elapsed / max(ok, 1))
        p50s.append(latencies[min(int(ok * 0.5), ok - 1)] if ok else 0.0)
        p99s.append(latencies[min(int(ok * 0.99), ok - 1)] if ok else 0.0)
        print(f"tensorzero run {run + 1}: {ok / elapsed:.0f} req/s, p50 {p50s[-1] * 1e3:.2f} ms, "
              f"p99 {p99s[-1] * 1e3:.2f} ms, {args.requests - ok} errors", file=sys.stderr)
    emit("tensorzero_embedded", "gateway", samples, args.requests,
         {"concurrency": args.concurrency, "p50_s": p50s, "p99_s": p99s, "errors": errors,
          "client": "AsyncTensorZeroGateway.build_embedded, asyncio tasks (in-process, no HTTP hop)",
          "version": tensorzero_version()},
         unit="s/request")


def tensorzero_version():
    from importlib.metadata import version

    return version("tensorzero")


def probe(args):
    directory = os.path.join(args.inputs, "probe")
    meta = json.load(open(os.path.join(args.inputs, "meta.json")))
    tools = json.load(open(os.path.join(args.inputs, "tools.json")))
    additional_tools = [{"name": t["name"], "description": t["description"], "parameters": t["input_schema"],
                         "strict": False} for t in tools]
    client = TensorZeroGateway.build_embedded(config_file=args.config)
    for case in ("missing_result", "orphan_result", "duplicate_result", "unknown_part", "mid_system"):
        tz_input = json.load(open(os.path.join(directory, f"{case}.tensorzero.json")))
        http("POST", f"{args.sim}/sim/reset")
        try:
            client.inference(model_name="probe", input=tz_input, additional_tools=additional_tools)
            requests = [r for r in http("GET", f"{args.sim}/sim/requests") if r["path"].endswith("/chat/completions")]
            body = json.loads(requests[-1]["body"]) if requests else None
            probe_line("tensorzero", case, {"outcome": "body" if body else "nothing_sent", "format": "openai-chat", "body": body})
        except Exception as error:  # noqa: BLE001
            requests = [r for r in http("GET", f"{args.sim}/sim/requests") if r["path"].endswith("/chat/completions")]
            probe_line("tensorzero", case, {"outcome": "exception", "error": f"{type(error).__name__}: {error}"[:300],
                                            "sent": len(requests)})
    # The cut stream: the simulator drops the connection after the event carrying the second
    # call's first argument fragment (same cut as the file-based probe of the other systems).
    http("POST", f"{args.sim}/sim/reset")
    reply = meta["probe"]["cut_stream_reply"]
    kept = meta["probe"]["cut_stream/openai-chat"]["events_kept"]
    http("POST", f"{args.sim}/sim/script", {"model": "probe_cut", "replies": [
        {"text": reply["text"], "tool_calls": reply["tool_calls"], "faults": {"disconnect_after_events": kept}}]})
    calls = {}
    finish = None
    error_text = None
    try:
        stream = client.inference(model_name="probe_cut", input={"messages": [{"role": "user", "content": "Weather?"}]},
                                  additional_tools=additional_tools, stream=True)
        for chunk in stream:
            for block in getattr(chunk, "content", []) or []:
                if getattr(block, "type", None) == "tool_call":
                    entry = calls.setdefault(block.id, {"id": block.id, "name": "", "raw_arguments": ""})
                    entry["name"] += block.raw_name or ""
                    entry["raw_arguments"] += block.raw_arguments or ""
            if getattr(chunk, "finish_reason", None):
                finish = str(chunk.finish_reason)
    except Exception as error:  # noqa: BLE001
        error_text = f"{type(error).__name__}: {error}"[:300]
    probe_line("tensorzero", "cut_stream/openai-chat",
               {"outcome": "exception" if error_text else "stream", "error": error_text,
                "tool_calls": list(calls.values()), "finish_reason": finish})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--sim", required=True, help="base URL of turnstile sim")
    parser.add_argument("--config", required=True, help="where to write the TensorZero config")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--mode", choices=("gateway", "probe", "all"), default="all")
    args = parser.parse_args()
    write_config(args.config, args.sim)
    if args.mode in ("probe", "all"):
        probe(args)
    if args.mode in ("gateway", "all"):
        asyncio.run(gateway(args))


if __name__ == "__main__":
    main()
