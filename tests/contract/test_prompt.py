"""Prompt rendering: plain-text task prompt and the native chat-template path."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from schemafill.contract.prompt import chat_messages, render_prompt
from schemafill.contract.toolcall import ToolRequest

REQ = ToolRequest.from_dict({
    "id": "r", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '{"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]}'},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "user", "content": "And in Rome?"}],
    "tools": [{"type": "function", "function": {"name": "weather", "description": "Current weather.",
               "parameters": {"type": "dict", "properties": {"city": {"type": "string"}}}}}],
})

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_plain_prompt_has_catalog_format_and_conversation_in_order():
    text = render_prompt(REQ, "plain")
    catalog_line = json.dumps(REQ.functions[0], ensure_ascii=False, separators=(",", ":"))
    assert catalog_line in text and '"type":"object"' in catalog_line  # normalised schema shown
    order = [text.index(s) for s in (catalog_line, '{"tool_calls": [{"name": "<tool name>"', "User: Weather in Paris?",
                                      "Tool result: {\"temp\": 21}", "User: And in Rome?")]
    assert order == sorted(order)
    assert text.endswith("\n\nResponse:\n")


def test_chat_prompt_uses_the_tokenizers_template():
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.chat_template = CHATML
    text = render_prompt(REQ, "chat", tok)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are a function-calling assistant")
    assert text.endswith("<|im_start|>user\nTool result: {\"temp\": 21}\n\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n")
    # tool results become user turns, merged with the following user turn: roles alternate
    roles = [m["role"] for m in chat_messages(REQ)]
    assert roles == ["system", "user", "assistant", "user"]


def test_chat_style_without_template_is_a_clear_error():
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    with pytest.raises(ValueError, match="prompt_style=plain"):
        render_prompt(REQ, "chat", tok)
    with pytest.raises(ValueError, match="unknown prompt style"):
        render_prompt(REQ, "markdown")


def test_tools_style_passes_the_catalog_to_the_targets_own_template():
    from schemafill.contract.response_format import HERMES

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.chat_template = "{% for t in tools %}TOOL {{ t['function']['name'] }}\n{% endfor %}" + CHATML
    text = render_prompt(REQ, "tools", tok, fmt=HERMES)
    assert text.startswith("TOOL weather\n<|im_start|>system\nBe brief.<|im_end|>")  # its own words, not ours
    assert "<|im_start|>tool\n{\"temp\": 21}" in text and "function-calling assistant" not in text


def test_tools_style_gives_a_chatml_target_without_tools_our_template(smol_tokenizer):
    from schemafill.contract.response_format import HERMES

    text = render_prompt(REQ, "tools", smol_tokenizer, fmt=HERMES)
    catalog = json.dumps(REQ.tools[0], ensure_ascii=False, separators=(",", ":"))
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\nYou can call the tools below, one JSON schema per line:"
                           f"\n<tools>\n{catalog}\n</tools>\n")
    assert HERMES.template in text and "SmolLM" not in text  # ours, not SmolLM2's default system turn
    assert text.endswith("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
                         "<|im_start|>user\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n")
    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    with pytest.raises(ValueError, match="needs a chat template that takes tools="):
        render_prompt(REQ, "tools", bare, fmt=HERMES)  # no template, no ChatML tokens
    with pytest.raises(ValueError, match="needs a chat template that takes tools="):
        render_prompt(REQ, "tools", smol_tokenizer)  # ours asks for hermes blocks, not the json format
