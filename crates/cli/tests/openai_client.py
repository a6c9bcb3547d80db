"""The official `openai` Python client, unchanged, against `tokenpath serve` (run by
openai_client.rs). Exits non-zero with a message on the first mismatch."""
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
model = client.models.list().data[0].id
msgs = [{"role": "user", "content": "Say hi."}]
fixed = {"ignore_eos": True}  # fixed output lengths, so usage can be checked exactly
greedy = {"temperature": 0}  # so streamed and non-streamed text can be compared

r = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, extra_body=fixed, **greedy)
assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0, r.usage
assert r.choices[0].finish_reason == "length", r.choices[0]
assert r.usage.prompt_tokens_details is None or r.usage.prompt_tokens_details.cached_tokens == 0

text, usage, roles = "", None, 0
stream = client.chat.completions.create(
    model=model, messages=msgs, max_tokens=5, stream=True, stream_options={"include_usage": True}, extra_body=fixed, **greedy
)
for chunk in stream:
    if chunk.choices:
        roles += chunk.choices[0].delta.role == "assistant"
        text += chunk.choices[0].delta.content or ""
    if chunk.usage:
        usage = chunk.usage
assert roles == 1, roles
assert usage is not None and usage.completion_tokens == 5, usage
assert text == r.choices[0].message.content, (text, r.choices[0].message.content)

c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, extra_body=fixed, **greedy)
assert c.usage.completion_tokens == 4 and c.choices[0].finish_reason == "length", c
parts = [x.choices[0].text for x in client.completions.create(
    model=model, prompt="Once upon a time", max_tokens=4, stream=True, extra_body=fixed, **greedy) if x.choices]
assert "".join(parts) == c.choices[0].text, (parts, c.choices[0].text)

try:
    client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=2)
    raise SystemExit("unknown model accepted")
except openai.NotFoundError:
    pass
try:
    client.chat.completions.create(model=model, messages=msgs, max_tokens=-1)
    raise SystemExit("negative max_tokens accepted")
except openai.BadRequestError:
    pass
print("openai client: ok")
