"""The official `openai`, `anthropic` and `google-genai` Python SDKs against `turnstile serve` in proxy mode.

Run by `tests/it/proxy_sdk.rs` with the venv `scripts/test` makes; argv[1] is the gateway's
base URL (embedded default: built-in simulator, scripted through `POST /sim/script` on the
gateway). Every check reads the SDKs' own parsed objects; any failed assertion or exception
exits non-zero with the traceback.
"""

import json
import sys
import urllib.request

import anthropic
import openai
from google import genai
from google.genai import types as genai_types

BASE = sys.argv[1]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TWO_CALLS = {
    "text": "Checking both.",
    "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Tokyo"}},
    ],
}
ANSWER = {"text": "Paris 12C, Tokyo 20C."}


def script(model, replies):
    request = urllib.request.Request(
        f"{BASE}/sim/script",
        data=json.dumps({"model": model, "replies": replies}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request) as response:
        assert response.status == 200, response.status


def sent_bodies(model):
    """The bodies the simulator received for `model`, in order, as JSON."""
    with urllib.request.urlopen(f"{BASE}/sim/requests") as response:
        requests = json.loads(response.read())
    bodies = [json.loads(request["body"]) for request in requests if request["body"]]
    return [body for body in bodies if body.get("model") == model]


def results_for(calls):
    """Tool results, deliberately in the reverse order of the calls (parallel tools finish in any order)."""
    weather = {"Paris": "12C", "Tokyo": "20C"}
    return [(call_id, weather[city]) for call_id, city in reversed(calls)]


def openai_chat(streaming):
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="sk-proxy-test", max_retries=0)
    model = f"sdk-chat-{'stream' if streaming else 'whole'}"
    script(model, [TWO_CALLS, ANSWER])
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
    ]
    if streaming:
        with client.chat.completions.stream(model=model, messages=messages, tools=tools) as stream:
            completion = stream.get_final_completion()
    else:
        completion = client.chat.completions.create(model=model, messages=messages, tools=tools)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert len(calls) == 2, calls
    cities = [json.loads(call.function.arguments)["city"] for call in calls]
    assert cities == ["Paris", "Tokyo"], cities
    assert all(call.function.name == "get_weather" for call in calls)
    assert len({call.id for call in calls}) == 2

    # Stateless follow-up: the whole history again, results in the reverse order.
    messages.append(choice.message.model_dump(exclude_none=True))
    for call_id, result in results_for([(call.id, city) for call, city in zip(calls, cities)]):
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    if streaming:
        stream = client.chat.completions.create(model=model, messages=messages, tools=tools, stream=True,
                                                stream_options={"include_usage": True})
        text = ""
        usage = None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for delta_choice in chunk.choices:
                text += delta_choice.delta.content or ""
        assert usage is not None and usage.prompt_tokens > 0, usage
    else:
        completion = client.chat.completions.create(model=model, messages=messages, tools=tools)
        text = completion.choices[0].message.content
        assert completion.choices[0].finish_reason == "stop"
        assert completion.usage.prompt_tokens > 0
    assert text == ANSWER["text"], text

    # An orphan result is refused with the provider's own error type, carrying our code.
    bad = messages[:2] + [{"role": "tool", "tool_call_id": "call_nobody", "content": "x"}]
    try:
        client.chat.completions.create(model=model, messages=bad)
    except openai.BadRequestError as error:
        body = error.response.json()
        codes = [violation["code"] for violation in body["error"]["violations"]]
        assert "orphan_result" in codes, body
    else:
        raise AssertionError("an orphan tool result was accepted")


def openai_responses(streaming):
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="sk-proxy-test", max_retries=0)
    model = f"sdk-responses-{'stream' if streaming else 'whole'}"
    script(model, [TWO_CALLS, ANSWER])
    tools = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": True}]
    items = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
    if streaming:
        with client.responses.stream(model=model, instructions="Be terse.", input=items, tools=tools) as stream:
            response = stream.get_final_response()
    else:
        response = client.responses.create(model=model, instructions="Be terse.", input=items, tools=tools)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 2, response.output
    cities = [json.loads(call.arguments)["city"] for call in calls]
    assert cities == ["Paris", "Tokyo"], cities
    assert response.output_text == "Checking both.", response.output_text

    items += [item.model_dump(exclude_none=True) for item in response.output]
    for call_id, result in results_for([(call.call_id, city) for call, city in zip(calls, cities)]):
        items.append({"type": "function_call_output", "call_id": call_id, "output": result})
    if streaming:
        with client.responses.stream(model=model, instructions="Be terse.", input=items, tools=tools) as stream:
            deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
            response = stream.get_final_response()
        assert "".join(deltas) == ANSWER["text"], deltas
    else:
        response = client.responses.create(model=model, instructions="Be terse.", input=items, tools=tools)
    assert response.output_text == ANSWER["text"], response.output_text
    assert response.status == "completed"


def openai_responses_chained():
    """The stateful style: the follow-up names the previous response instead of resending it."""
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="sk-proxy-test", max_retries=0)
    model = "sdk-responses-chained"
    script(model, [TWO_CALLS, ANSWER])
    tools = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": True}]
    first = client.responses.create(model=model, instructions="Be terse.", tools=tools,
                                    input="Weather in Paris and Tokyo?")
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 2, first.output
    outputs = [{"type": "function_call_output", "call_id": call_id, "output": result}
               for call_id, result in results_for([(call.call_id, json.loads(call.arguments)["city"]) for call in calls])]
    second = client.responses.create(model=model, previous_response_id=first.id, tools=tools, input=outputs)
    assert second.output_text == ANSWER["text"], second.output_text
    assert second.id != first.id


def anthropic_messages(streaming):
    client = anthropic.Anthropic(base_url=BASE, api_key="sk-ant-proxy-test", max_retries=0)
    model = f"sdk-claude-{'stream' if streaming else 'whole'}"
    script(model, [TWO_CALLS, ANSWER])
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    messages = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
    if streaming:
        with client.messages.stream(model=model, max_tokens=256, system="Be terse.", messages=messages, tools=tools) as stream:
            message = stream.get_final_message()
    else:
        message = client.messages.create(model=model, max_tokens=256, system="Be terse.", messages=messages, tools=tools)
    assert message.stop_reason == "tool_use", message
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [use.input for use in uses] == [{"city": "Paris"}, {"city": "Tokyo"}], uses
    texts = [block.text for block in message.content if block.type == "text"]
    assert texts == ["Checking both."], texts

    messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call_id, "content": result}
        for call_id, result in results_for([(use.id, use.input["city"]) for use in uses])
    ]})
    if streaming:
        with client.messages.stream(model=model, max_tokens=256, system="Be terse.", messages=messages, tools=tools) as stream:
            text = "".join(stream.text_stream)
            message = stream.get_final_message()
        assert text == ANSWER["text"], text
    else:
        message = client.messages.create(model=model, max_tokens=256, system="Be terse.", messages=messages, tools=tools)
    assert message.stop_reason == "end_turn", message
    assert message.content[0].text == ANSWER["text"], message.content
    assert message.usage.input_tokens > 0

    # A duplicate result is refused with Anthropic's error type, carrying our code.
    duplicate = messages[:-1] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": uses[0].id, "content": "12C"},
        {"type": "tool_result", "tool_use_id": uses[0].id, "content": "12C"},
        {"type": "tool_result", "tool_use_id": uses[1].id, "content": "20C"},
    ]}]
    try:
        client.messages.create(model=model, max_tokens=256, messages=duplicate, tools=tools)
    except anthropic.BadRequestError as error:
        assert "duplicate_result" in json.dumps(error.body), error.body
    else:
        raise AssertionError("a duplicate tool result was accepted")


def openai_forced_tool_and_json_schema():
    """A forced tool without parallel calls, then structured output from a pydantic model: both reach the provider."""
    import pydantic

    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="sk-proxy-test", max_retries=0)
    model = "sdk-chat-forced"
    script(model, [{"text": "Checking.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
                   {"text": '{"answer": "12C"}'}])
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    completion = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
        tool_choice=forced, parallel_tool_calls=False)
    assert completion.choices[0].message.tool_calls[0].function.name == "get_weather", completion
    sent = sent_bodies(model)[-1]
    assert sent["tool_choice"] == forced, sent
    assert sent["parallel_tool_calls"] is False, sent

    class Answer(pydantic.BaseModel):
        answer: str

    parsed = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Weather in Paris, as JSON?"}], response_format=Answer)
    assert parsed.choices[0].message.parsed == Answer(answer="12C"), parsed
    sent = sent_bodies(model)[-1]
    format = sent["response_format"]
    assert format["type"] == "json_schema", format
    assert format["json_schema"]["name"] == "Answer", format
    assert format["json_schema"]["strict"] is True, format
    assert format["json_schema"]["schema"]["properties"]["answer"]["type"] == "string", format


def anthropic_tool_runner():
    """The SDK's recommended tool loop: its `thread` is refused with the code it falls back on, and it finishes
    statelessly with the whole history."""
    client = anthropic.Anthropic(base_url=BASE, api_key="sk-ant-proxy-test", max_retries=0)
    model = "sdk-claude-runner"
    script(model, [{"text": "Checking.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
                   {"text": "Paris 12C."}])

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return {"Paris": "12C"}[city]

    runner = client.beta.messages.tool_runner(
        model=model, max_tokens=256, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[get_weather],
        tool_choice={"type": "any"})
    final = runner.until_done()
    assert final.content[-1].text == "Paris 12C.", final
    sent = sent_bodies(model)
    assert len(sent) == 2, sent
    assert all("thread" not in body for body in sent), sent
    assert sent[0]["tool_choice"] == {"type": "any"}, sent[0]
    results = [block for block in sent[1]["messages"][-1]["content"] if block["type"] == "tool_result"]
    assert len(results) == 1 and len(sent[1]["messages"]) == 3, sent[1]


def anthropic_streamed_usage():
    """A streamed answer reports the simulator's own counts: in `message_start` (its start event,
    not the gateway's admission estimate) and, cumulatively, in the final message."""
    client = anthropic.Anthropic(base_url=BASE, api_key="sk-ant-proxy-test", max_retries=0)
    model = "sdk-claude-usage"
    text = "Counted by the provider, slowly."
    script(model, [{"text": text, "faults": {"delay_ms": 20}}])
    messages = [{"role": "user", "content": "Count the tokens of this question, please."}]
    starts = []
    with client.messages.stream(model=model, max_tokens=64, system="Count carefully.", messages=messages) as stream:
        for event in stream:
            if event.type == "message_start":
                starts.append(event.message.usage)
        message = stream.get_final_message()
    with urllib.request.urlopen(f"{BASE}/sim/requests") as http:
        bodies = [request["body"] for request in json.loads(http.read())
                  if request["body"] and json.loads(request["body"]).get("model") == model]
    assert len(bodies) == 1, bodies
    # The simulator's counts: a quarter of the request's bytes in, of the text's bytes out.
    provider_input = max(len(bodies[0].encode()) // 4, 1)
    provider_output = max(len(text.encode()) // 4, 1)
    assert len(starts) == 1 and starts[0].input_tokens == provider_input, (starts, provider_input)
    assert message.usage.input_tokens == provider_input, (message.usage, provider_input)
    assert message.usage.output_tokens == provider_output, (message.usage, provider_output)


def gemini_default_api_version():
    """google-genai on its default API version (`v1`): a forced function call, then a JSON-schema answer."""
    client = genai.Client(api_key="g-proxy-test", http_options=genai_types.HttpOptions(base_url=BASE))
    assert client._api_client._http_options.api_version == "v1", client._api_client._http_options
    model = "sdk-gemini-v1"
    script(model, [{"text": "Checking.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
                   {"text": '{"answer": "12C"}'}])
    declaration = genai_types.FunctionDeclaration(name="get_weather", description="Weather",
                                                  parameters_json_schema=WEATHER)
    config = genai_types.GenerateContentConfig(
        tools=[genai_types.Tool(function_declarations=[declaration])],
        automatic_function_calling=genai_types.AutomaticFunctionCallingConfig(disable=True),
        tool_config=genai_types.ToolConfig(function_calling_config=genai_types.FunctionCallingConfig(
            mode="ANY", allowed_function_names=["get_weather"])))
    response = client.models.generate_content(model=model, contents="Weather in Paris?", config=config)
    calls = response.function_calls
    assert [call.name for call in calls] == ["get_weather"], response
    assert calls[0].args == {"city": "Paris"}, calls
    with urllib.request.urlopen(f"{BASE}/sim/requests") as http:
        requests = [request for request in json.loads(http.read()) if model in request["path"]]
    sent = json.loads(requests[-1]["body"])
    assert sent["toolConfig"] == {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}}, sent

    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    chunks = client.models.generate_content_stream(
        model=model, contents="Weather in Paris, as JSON?",
        config=genai_types.GenerateContentConfig(response_mime_type="application/json", response_json_schema=answer))
    text = "".join(chunk.text or "" for chunk in chunks)
    assert json.loads(text) == {"answer": "12C"}, text
    with urllib.request.urlopen(f"{BASE}/sim/requests") as http:
        requests = [request for request in json.loads(http.read()) if model in request["path"]]
    sent = json.loads(requests[-1]["body"])["generationConfig"]
    assert sent["responseMimeType"] == "application/json" and sent["responseJsonSchema"] == answer, sent

    # An unknown method is Gemini's own 404, which the SDK raises as its typed error.
    try:
        client.models.embed_content(model=model, contents="x")
    except genai.errors.ClientError as error:
        assert error.code == 404, error
    else:
        raise AssertionError("embed_content was answered")


def openai_conversations_refused():
    """OpenAI's Conversations API (the Agents SDK's conversation session creates one with
    `items`) is refused as the SDK's own NotFoundError, code `unsupported_endpoint`."""
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="sk-proxy-test", max_retries=0)
    calls = [
        lambda: client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hello!"}]),
        lambda: client.conversations.create(items=[], metadata={"topic": "demo"}),
        lambda: client.conversations.items.list("conv_123", limit=10),
        lambda: client.conversations.items.create("conv_123", items=[{"role": "user", "content": "Hi"}]),
    ]
    for call in calls:
        try:
            call()
        except openai.NotFoundError as error:
            assert error.code == "unsupported_endpoint", error.body
            assert error.type == "not_found_error", error.body
        else:
            raise AssertionError("OpenAI's Conversations API was answered")


if __name__ == "__main__":
    for streaming in (False, True):
        openai_chat(streaming)
        openai_responses(streaming)
        anthropic_messages(streaming)
    openai_responses_chained()
    openai_forced_tool_and_json_schema()
    anthropic_tool_runner()
    anthropic_streamed_usage()
    gemini_default_api_version()
    openai_conversations_refused()
    print(f"ok: openai {openai.__version__}, anthropic {anthropic.__version__}, google-genai {genai.__version__}")
