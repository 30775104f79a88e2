"""LiteLLM side of bench/peers (run by bench/peers/run inside target/peers/venv).

Workloads, on the inputs written by `turnstile-peerbench gen`:

- prepare/N: the OpenAI-format history file's bytes → Anthropic Messages request body bytes:
  `json.loads` → `AnthropicConfig().map_openai_params(...)` (OpenAI tools → Anthropic tools,
  max_tokens) → `AnthropicConfig().transform_request(...)` → `json.dumps`. This is the
  provider transformation `litellm.completion(model="anthropic/...")` runs; entry points as
  read from the litellm 1.110.2 wheel (`llms/anthropic/chat/transformation.py`
  `AnthropicConfig.transform_request(model, messages, optional_params, litellm_params,
  headers)`, `map_openai_params(non_default_params, optional_params, model, drop_params)`) and
  listed in ../shared/reference/peers.md §5 "Exact entry points" A.
  Also `litellm.utils.return_raw_request(CallTypes.completion, kwargs)` (the whole
  `litellm.completion` pipeline up to the HTTP call, "BETA" in utils.py) as a second row.
- step/N: the agent step — the history held parsed, one user message appended, the whole
  history transformed again (what `litellm.completion` converts on every step of a loop).
- stream/<api>/<size>: raw SSE bytes → assembled response: decode, split lines (what httpx's
  `iter_lines` hands LiteLLM), the provider's chunk iterator
  (`llms/anthropic/chat/handler.py::ModelResponseIterator`,
  `llms/openai/chat/gpt_transformation.py::OpenAIChatCompletionStreamingHandler`), then
  `litellm.stream_chunk_builder(chunks, messages)` (streaming_chunk_builder_utils.py).
- probe: the six bad inputs; prints what LiteLLM did (raw observations; bench/peers/report.py
  classifies them), with `litellm.modify_params` off (the default) and on.
"""

import argparse
import copy
import json
import os
import sys

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, emit_unavailable, measure, probe_line  # noqa: E402

import litellm  # noqa: E402

litellm.suppress_debug_info = True
from litellm.llms.anthropic.chat.handler import ModelResponseIterator  # noqa: E402
from litellm.llms.anthropic.chat.transformation import AnthropicConfig  # noqa: E402
from litellm.llms.openai.chat.gpt_transformation import OpenAIChatCompletionStreamingHandler  # noqa: E402
from litellm.types.utils import CallTypes, ModelResponseStream  # noqa: E402

MODEL = "claude-sonnet-4-5"
MAX_TOKENS = 1024


def transform(raw: bytes) -> bytes:
    data = json.loads(raw)
    config = AnthropicConfig()
    optional = config.map_openai_params(
        non_default_params={"tools": data["tools"], "max_tokens": MAX_TOKENS},
        optional_params={},
        model=MODEL,
        drop_params=False,
    )
    body = config.transform_request(
        model=MODEL, messages=data["messages"], optional_params=optional, litellm_params={}, headers={}
    )
    return json.dumps(body).encode()


STEP_MESSAGE = {"role": "user", "content": "And the next question: The committed history is replayed to the "
                "provider on every turn, so the adapter renders the same blocks again and again; only the "
                "newest turn is new work. Numbers 1, 2, 3."}


def step(history) -> bytes:
    """The agent step: the history held parsed (as a loop holds it), one user message appended,
    the whole history transformed again (map_openai_params + transform_request + json.dumps),
    the message popped afterwards so every repetition converts the same history + one."""
    history["messages"].append(STEP_MESSAGE)
    try:
        config = AnthropicConfig()
        optional = config.map_openai_params(
            non_default_params={"tools": history["tools"], "max_tokens": MAX_TOKENS},
            optional_params={},
            model=MODEL,
            drop_params=False,
        )
        body = config.transform_request(
            model=MODEL, messages=history["messages"], optional_params=optional, litellm_params={}, headers={}
        )
        return json.dumps(body).encode()
    finally:
        history["messages"].pop()


def raw_request(raw: bytes):
    data = json.loads(raw)
    result = litellm.utils.return_raw_request(
        CallTypes.completion,
        {"model": f"anthropic/{MODEL}", "messages": data["messages"], "tools": data["tools"], "max_tokens": MAX_TOKENS},
    )
    if not result.get("raw_request_body"):
        raise RuntimeError(f"return_raw_request gave no body: {result.get('error')}")
    return result


def iterator_for(api: str, lines):
    if api == "anthropic":
        return ModelResponseIterator(streaming_response=iter(lines), sync_stream=True, json_mode=False)
    if api == "openai-chat":
        return OpenAIChatCompletionStreamingHandler(streaming_response=iter(lines), sync_stream=True)
    raise KeyError(api)


def assemble(api: str, raw: bytes):
    lines = raw.decode("utf-8").splitlines()
    chunks = [chunk for chunk in iterator_for(api, lines) if isinstance(chunk, ModelResponseStream)]
    return litellm.stream_chunk_builder(chunks=chunks, messages=[{"role": "user", "content": "x"}])


def summary(response):
    message = response.choices[0].message
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in (message.tool_calls or [])
    ]
    return {"finish_reason": response.choices[0].finish_reason, "text_chars": len(message.content or ""),
            "tool_calls": calls}


def micro(args, meta):
    for blocks in ("20", "200", "2000"):
        workload = f"prepare/{blocks}"
        if not wanted(args, workload):
            continue
        raw = open(os.path.join(args.inputs, f"conv-{blocks}.openai.json"), "rb").read()
        body = transform(raw)
        samples, iterations = measure(lambda: transform(raw), args.runs, args.min_run)
        emit("litellm", workload, samples, iterations,
             {"input_bytes": len(raw), "body_bytes": len(body), "version": litellm_version(),
              "what": "json.loads + AnthropicConfig.map_openai_params + transform_request + json.dumps"})
        try:
            raw_request(raw)
            samples, iterations = measure(lambda: raw_request(raw), args.runs, args.min_run)
            emit("litellm_raw_request", workload, samples, iterations,
                 {"what": "json.loads + litellm.utils.return_raw_request(completion, anthropic/...)"})
        except Exception as error:  # noqa: BLE001 - reported, never faked
            emit_unavailable("litellm_raw_request", workload, f"{type(error).__name__}: {error}")
    for blocks in ("20", "200", "2000"):
        workload = f"step/{blocks}"
        if not wanted(args, workload):
            continue
        history = json.loads(open(os.path.join(args.inputs, f"conv-{blocks}.openai.json"), "rb").read())
        first = step(history)
        # LiteLLM must not have changed the held history: a second step gives the same body.
        if step(history) != first:
            emit_unavailable("litellm_step", workload, "transform_request changed the held history between steps")
            continue
        samples, iterations = measure(lambda: step(history), args.runs, args.min_run)
        emit("litellm_step", workload, samples, iterations,
             {"body_bytes": len(first), "version": litellm_version(),
              "what": "history held parsed: append one user message + map_openai_params + transform_request + json.dumps"})
    for key, info in sorted(meta["streams"].items()):
        api = key.split("/")[0]
        workload = f"stream/{key}"
        if not wanted(args, workload):
            continue
        if api not in ("anthropic", "openai-chat"):
            continue
        raw = open(os.path.join(args.inputs, info["file"]), "rb").read()
        try:
            check = summary(assemble(api, raw))
        except Exception as error:  # noqa: BLE001
            emit_unavailable("litellm", workload, f"{type(error).__name__}: {error}")
            continue
        runs = args.runs
        samples, iterations = measure(lambda: assemble(api, raw), runs, args.min_run)
        emit("litellm", workload, samples, iterations,
             {"bytes": len(raw), "events": info["events"], "tool_calls": len(check["tool_calls"]),
              "finish_reason": check["finish_reason"],
              "what": "decode + splitlines + provider chunk iterator + litellm.stream_chunk_builder"})


def wanted(args, workload):
    large = workload.endswith("/2000") or workload.endswith("/100k")
    return workload.startswith(args.only) and not (args.skip_large and large)


def litellm_version():
    from importlib.metadata import version

    return version("litellm")


def probe(args):
    directory = os.path.join(args.inputs, "probe")
    for modify in (False, True):
        litellm.modify_params = modify
        system = "litellm_modify_params" if modify else "litellm"
        for case in ("missing_result", "orphan_result", "duplicate_result", "unknown_part", "mid_system"):
            raw = open(os.path.join(directory, f"{case}.openai.json"), "rb").read()
            try:
                body = json.loads(transform(raw))
                probe_line(system, case, {"outcome": "body", "format": "anthropic", "body": body})
            except Exception as error:  # noqa: BLE001
                probe_line(system, case, {"outcome": "exception", "error": f"{type(error).__name__}: {error}"[:300]})
        for api in ("anthropic", "openai-chat"):
            raw = open(os.path.join(directory, f"cut_stream.{api}.sse"), "rb").read()
            try:
                probe_line(system, f"cut_stream/{api}", {"outcome": "assembled", **summary(assemble(api, raw))})
            except Exception as error:  # noqa: BLE001
                probe_line(system, f"cut_stream/{api}",
                           {"outcome": "exception", "error": f"{type(error).__name__}: {error}"[:300]})
    litellm.modify_params = False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--min-run", type=float, default=0.3)
    parser.add_argument("--only", default="")
    parser.add_argument("--skip-large", action="store_true", help="no 2,000-block conversation, no 100k stream")
    parser.add_argument("--mode", choices=("micro", "probe", "all"), default="all")
    args = parser.parse_args()
    meta = json.load(open(os.path.join(args.inputs, "meta.json")))
    if args.mode in ("micro", "all"):
        micro(args, meta)
    if args.mode in ("probe", "all"):
        probe(args)


if __name__ == "__main__":
    main()
