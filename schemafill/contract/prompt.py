"""Prompt rendering: what the target reads before it writes a tool-call response.

Three styles (``model.prompt_style``): ``plain``, the paper's plain-text task prompt
(catalog + output format + conversation, no chat template); ``chat``, the same
instructions as a system message rendered by the target's own chat template; and ``tools``,
as the target's users prompt it: the conversation alone, the catalog passed as ``tools=`` to
the target's own chat template (or, where that template has no tools, to ours:
``tool_template``), which asks for the target's native format. Every method of every stage
renders prompts here, so all decoders see identical prompt tokens.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from schemafill.contract.response_format import JSON, ResponseFormat
from schemafill.contract.tool_template import CHATML_TOOLS, is_chatml, takes_tools
from schemafill.contract.toolcall import ToolRequest

PROMPT_STYLES = ("plain", "chat", "tools")


class PromptSettings(Protocol):
    """How a target is prompted (``config.ModelConfig`` holds these)."""

    prompt_style: str
    chat_template_kwargs: dict[str, Any]

    @property
    def fmt(self) -> ResponseFormat: ...

INSTRUCTIONS = (
    "You are a function-calling assistant. Serve the user's request by calling tools "
    "from this catalog (one JSON schema per line):"
)

# how each kind of response format is asked for: the reply's shape, and the reply when no tool fits
_SHAPES = {
    "object": ("Reply with exactly one JSON object and nothing else, in this format:\n{template}\n"
               "Add one entry per call", "If no tool fits, reply {empty}."),
    "tagged": ("Reply with one block per call and nothing else, each in this format:\n{template}\n"
               "Write one block per call, one after another", "If no tool fits, reply in words: {empty}"),
    "lead": ("Reply with the calls and nothing else, in this format:\n{template}\n"
             "Add one entry per call", "If no tool fits, reply in words: {empty}"),
}


def format_instructions(fmt: ResponseFormat = JSON) -> str:
    shape, empty = _SHAPES["tagged" if fmt.open_tag is not None else "lead" if fmt.lead is not None else "object"]
    return (shape.format(template=fmt.template)
            + ", in the order the calls should run; a request may need several calls, "
            "of the same or different tools. Use only tools and arguments from the catalog. "
            + empty.format(empty=fmt.empty))


_SPEAKERS = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool result"}


def render_catalog(request: ToolRequest) -> str:
    # compact separators: catalogs are most of a prompt's tokens, and prompt length is prefill time
    return "\n".join(json.dumps(fn, ensure_ascii=False, separators=(",", ":")) for fn in request.functions)


def output_instructions(request: ToolRequest) -> str:
    """What a structured output asks of the target: one object under its schema (beside tools,
    whenever it answers without calling one)."""
    out = request.output
    schema = json.dumps(out["schema"], ensure_ascii=False, separators=(",", ":"))
    about = f" ({out['description']})" if out.get("description") else ""
    when = "Reply" if request.object_only else "When you answer without calling a tool, reply"
    return (f"{when} with exactly one JSON object and nothing else: the {out['name']}{about}, "
            f"following this JSON Schema:\n{schema}")


def system_text(request: ToolRequest, fmt: ResponseFormat = JSON) -> str:
    if request.object_only:
        return output_instructions(request)
    text = f"{INSTRUCTIONS}\n{render_catalog(request)}\n\n{format_instructions(fmt)}"
    return text if request.output is None else f"{text}\n\n{output_instructions(request)}"


def render_plain(request: ToolRequest, fmt: ResponseFormat = JSON) -> str:
    turns = "\n".join(f"{_SPEAKERS[m['role']]}: {m['content']}" for m in request.messages)
    return f"{system_text(request, fmt)}\n\n{turns}\n\nResponse:\n"


def chat_messages(request: ToolRequest, fmt: ResponseFormat = JSON) -> list[dict]:
    """Messages for a chat template: our instructions as the system turn.

    Tool results become user turns and consecutive turns of one role are merged, because
    several templates (Mistral's among them) reject a ``tool`` role without call ids and
    insist on alternating roles.
    """
    system = system_text(request, fmt)
    merged: list[dict] = []
    for m in request.messages:
        role, content = m["role"], m["content"]
        if role == "system":
            system = f"{content}\n\n{system}"
            continue
        if role == "tool":
            role, content = "user", f"Tool result: {content}"
        if merged and merged[-1]["role"] == role:
            merged[-1]["content"] += f"\n\n{content}"
        else:
            merged.append({"role": role, "content": content})
    return [{"role": "system", "content": system}, *merged]


def render_chat(request: ToolRequest, tokenizer: Any, template_kwargs: dict | None = None,
                fmt: ResponseFormat = JSON) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "prompt_style=chat needs a tokenizer with a chat template; "
            "this one has none (use model.prompt_style=plain)"
        )
    return tokenizer.apply_chat_template(chat_messages(request, fmt), tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))


def render_tools(request: ToolRequest, tokenizer: Any, template_kwargs: dict | None = None,
                 fmt: ResponseFormat = JSON) -> str:
    """The conversation through the target's own chat template with the catalog as ``tools=``;
    a ChatML tokenizer whose template has no tools gets ours (for the tagged formats' blocks)."""
    messages = [{"role": m["role"], "content": m["content"]} for m in request.messages]
    if request.output is not None:  # the schema goes where the template's own system turn goes
        messages = [{"role": "system", "content": output_instructions(request)}, *messages]
    kwargs = {"tokenize": False, "add_generation_prompt": True, **(template_kwargs or {})}
    if takes_tools(tokenizer):
        return tokenizer.apply_chat_template(messages, tools=request.tools, **kwargs)
    if fmt.open_tag is not None and is_chatml(tokenizer):
        return tokenizer.apply_chat_template(messages, tools=request.tools, chat_template=CHATML_TOOLS,
                                             call_format=fmt.template, **kwargs)
    raise ValueError(f"prompt_style=tools needs a chat template that takes tools=; this tokenizer's has none, and "
                     f"ours writes ChatML turns asking for <tool_call> blocks (response_format={fmt.name}): "
                     "use model.prompt_style=plain or chat")


def render_prompt(request: ToolRequest, style: str, tokenizer: Any = None, template_kwargs: dict | None = None,
                  fmt: ResponseFormat = JSON) -> str:
    if style == "plain":
        return render_plain(request, fmt)
    if style == "chat":
        return render_chat(request, tokenizer, template_kwargs, fmt)
    if style == "tools":
        return render_tools(request, tokenizer, template_kwargs, fmt)
    raise ValueError(f"unknown prompt style {style!r}; expected one of {PROMPT_STYLES}")


def prompt_ids(request: ToolRequest, style: str, tokenizer: Any, template_kwargs: dict | None = None,
               fmt: ResponseFormat = JSON) -> list[int]:
    """Prompt token ids, asking for ``fmt``. A chat template writes its own BOS text; a plain
    prompt gets the tokenizer's usual special tokens (e.g. Llama 3's BOS; none for SmolLM2)."""
    text = render_prompt(request, style, tokenizer, template_kwargs, fmt)
    return tokenizer(text, add_special_tokens=style == "plain").input_ids


def model_prompt_ids(request: ToolRequest, model: PromptSettings, tokenizer: Any) -> list[int]:
    """Prompt token ids as the configured target reads them: its style, template kwargs and format."""
    return prompt_ids(request, model.prompt_style, tokenizer, model.chat_template_kwargs, model.fmt)


def response_ids(text: str, tokenizer: Any) -> list[int]:
    """Token ids of response text as the target would write it: no special tokens."""
    return tokenizer(text, add_special_tokens=False).input_ids
