"""A response as an OpenAI assistant message: whole (``message``) and streamed (``MessageStream``).

Both read the text through the target's ``ResponseFormat.call_spans``, which only grows with the text,
so the deltas a stream sends for any sequence of growing prefixes concatenate to exactly the
whole message of the finished text: the calls' names, their arguments as the raw JSON text
the target wrote, the content when the response is not a tool-call response. Engines have
had bugs exactly where several tokens arrive at once (vLLM #38168, #41967); here a round's
accepted tokens are just a longer prefix. Pure: standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from schemafill.contract.response_format import JSON, ResponseFormat


def _tool_call(call_id: str, name: str | None, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name or "", "arguments": arguments}}


def message(text: str, call_id: Callable[[int], str], parse_calls: bool = True, fmt: ResponseFormat = JSON) -> dict:
    """The assistant message of a finished response (``parse_calls=False``: content only,
    as for ``tool_choice: none``)."""
    if parse_calls and fmt.is_calls(text):
        calls = [_tool_call(call_id(i), c.name, c.arguments) for i, c in enumerate(fmt.call_spans(text))]
        # a tool-call response that calls nothing said nothing either
        return {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
            {"role": "assistant", "content": ""}
    return {"role": "assistant", "content": text}


def finish_reason(msg: dict, stop: str, text: str = "", fmt: ResponseFormat = JSON) -> str:
    """``length`` when the cap cut the response, ``tool_calls`` when it called and completed the
    response (an EOS inside a call leaves calls a client cannot run: ``stop``), else ``stop``."""
    if stop == "length":
        return "length"
    return "tool_calls" if msg.get("tool_calls") and fmt.complete(text, stop) else "stop"


@dataclass
class MessageStream:
    """The deltas of one streamed message, fed the response text after every round."""

    call_id: Callable[[int], str]
    parse_calls: bool = True
    fmt: ResponseFormat = JSON
    text: str = ""  # what has been read so far
    content_sent: int = 0
    sent: list[int] = field(default_factory=list)  # argument characters sent, per started call
    mode: bool | None = None  # True: tool calls, False: content, None: not known yet
    finished: bool = False  # the final text was fed: nothing more to send

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """The deltas ``text`` adds to what was fed before (``final``: the finished response)."""
        if not text.startswith(self.text):
            raise ValueError("streamed text must only grow: the detokenized response revised what was sent")
        self.text = text
        if self.finished:
            return []
        self.finished = final
        if self.mode is None:
            self.mode = self.fmt.is_calls(text) if self.parse_calls else False
            if self.mode is None and final:
                self.mode = False
        if final and not self.content_sent and not self.sent and not self.fmt.call_spans(text) and \
                (self.mode or not text):  # an empty reply: its content is "", not absent
            self.mode = self.mode if self.mode is not None else False
            return [{"content": ""}]
        if self.mode is None:  # still a prefix of the header: wait
            return []
        if not self.mode:
            piece, self.content_sent = text[self.content_sent:], len(text)
            return [{"content": piece}] if piece else []
        deltas = []
        for i, c in enumerate(self.fmt.call_spans(text)):
            if i == len(self.sent):
                if c.name is None and not c.closed and not final:
                    break  # a call starts once its name is known
                deltas.append({"tool_calls": [{"index": i, **_tool_call(self.call_id(i), c.name, "")}]})
                self.sent.append(0)
            piece = c.arguments[self.sent[i]:]
            if piece:
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                self.sent[i] = len(c.arguments)
        return deltas
