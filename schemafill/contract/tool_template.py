"""Our chat template for targets whose own template has no tools (the built-in SmolLM2's):
ChatML turns, the catalog in the system turn, calls as ``<tool_call>`` blocks (the tagged
format's own block, given as ``call_format``: hermes or hermes3), tool results in
``<tool_response>`` blocks. Written for this project in the layout Qwen2.5 and Hermes-3 use,
so a target fine-tuned on it answers as those models do (``prompt_style=tools`` with
``response_format=hermes``). Rendered by the tokenizer's own ``apply_chat_template``.
"""

from __future__ import annotations

from typing import Any

# HF renders chat templates with trim_blocks and lstrip_blocks on: a block tag's own line
# break is dropped, so the text below is laid out line by line as it renders
CHATML_TOOLS = """\
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system = messages[0]['content'] -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system = 'You are a helpful assistant.' -%}
    {%- set turns = messages -%}
{%- endif -%}
<|im_start|>system
{{ system }}
{%- if tools %}


You can call the tools below, one JSON schema per line:
<tools>
{% for tool in tools %}
{{ tool | tojson(separators=(',', ':')) }}
{% endfor %}
</tools>

To call tools, reply with one block per call, in the order the calls should run, and nothing else:
{{ call_format }}
{%- endif %}
<|im_end|>
{% for message in turns %}
{% if message['role'] == 'tool' %}
<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_name", "parameters": {"type": "object"}}}


def takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's own chat template writes a ``tools=`` catalog into the prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    turn = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(turn, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses tools outright
        return False
    return "probe_tool_name" in text


def is_chatml(tokenizer: Any) -> bool:
    """Whether ``<|im_start|>`` and ``<|im_end|>`` are single tokens of this vocabulary."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    return all(i is not None and i != tokenizer.unk_token_id for i in ids)
