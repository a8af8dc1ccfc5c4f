"""Public tool-calling corpora → ToolRequest.

* **BFCL v3** from the files of the PyPI package ``nvidia-bfcl`` (read as data; its code is
  never imported). References come from ``possible_answer`` (first acceptable value; a field
  whose first acceptable value is the optional-empty marker ``""`` is omitted, as the paper's
  App. C.1 counts fields) or, for ``exec_*`` and multi-turn records, from Python call strings
  parsed with ``ast``. Multi-turn records contribute their first turn.
* **Glaive function calling** through ``datasets`` (hub id or local path): one request per
  assistant ``<functioncall>`` decision point, with the conversation before it as context.
* **JSONL** of the user's own requests in OpenAI ``tools`` format (``schemafill.contract.records``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

from schemafill.contract import schemas
from schemafill.contract.records import RejectLog, json_lines
from schemafill.contract.toolcall import InvalidRequest, ToolCall, ToolRequest

BFCL_SOURCE = "bfcl_v3"
GLAIVE_SOURCE = "glaive"

# BFCL's multi-turn records name API classes; their function docs live in these files.
_MULTI_TURN_DOCS = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}


# ---------------------------------------------------------------------------- BFCL
def bfcl_data_dir(override: str | None = None) -> Path:
    """BFCL v3's ``bfcl/data`` folder: ``override``, else the files ``make setup`` extracts from the
    ``nvidia-bfcl`` wheel into ``<venv>/share/nvidia-bfcl-<version>`` (its code and its pinned
    dependencies are never installed), else an installed ``nvidia-bfcl``."""
    if override:
        path = Path(override)
    else:
        extracted = sorted(Path(sys.prefix, "share").glob("nvidia-bfcl-*/bfcl/data"))
        spec = importlib.util.find_spec("bfcl")  # locates an installed package without importing it
        if extracted:
            path = extracted[-1]
        elif spec is not None and spec.submodule_search_locations:
            path = Path(list(spec.submodule_search_locations)[0]) / "data"
        else:
            raise FileNotFoundError(
                "BFCL v3 data not found: `make setup` extracts it from the nvidia-bfcl wheel "
                f"(into {Path(sys.prefix, 'share')}/nvidia-bfcl-<version>), or set data.bfcl_dir=<folder with "
                "BFCL_v3_*.json>")
    if not any(path.glob("BFCL_v3_*.json")):
        raise FileNotFoundError(f"no BFCL_v3_*.json files in {path}")
    return path


def bfcl_version(data_dir: Path) -> str:
    """The wheel's version (its dist-info beside the extracted files, or the installed one), else the folder."""
    info = sorted(data_dir.resolve().parent.parent.glob("nvidia_bfcl-*.dist-info"))
    if info:
        return info[-1].name.removeprefix("nvidia_bfcl-").removesuffix(".dist-info")
    try:
        return metadata.version("nvidia-bfcl")
    except metadata.PackageNotFoundError:
        return str(data_dir.resolve())


def bfcl_categories(data_dir: Path) -> list[str]:
    return sorted(p.stem.removeprefix("BFCL_v3_") for p in data_dir.glob("BFCL_v3_*.json"))


def load_bfcl(data_dir: Path, categories: Iterable[str], log: RejectLog) -> list[ToolRequest]:
    """Every request of the given BFCL categories, with references where BFCL has them."""
    out = []
    for category in categories:
        path = data_dir / f"BFCL_v3_{category}.json"
        answers = _bfcl_answers(data_dir / "possible_answer" / path.name)
        for lineno, record in json_lines(path, log):
            if not isinstance(record, dict):
                log.add(str(path), lineno, None, f"record is a {type(record).__name__}, not an object")
                continue
            rid = record.get("id") or f"{category}_{lineno - 1}"
            try:
                out.append(_bfcl_request(record, rid, category, answers, data_dir))
            except InvalidRequest as e:
                log.add(str(path), lineno, rid, str(e))
    return out


def _bfcl_answers(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    return {rec["id"]: rec["ground_truth"] for _, rec in json_lines(path)}


def _bfcl_request(record: dict, rid: str, category: str, answers: dict, data_dir: Path) -> ToolRequest:
    question = record.get("question")
    if isinstance(question, str):
        question = [{"role": "user", "content": question}]
    if isinstance(question, list) and question and isinstance(question[0], list):
        question = question[0]  # multi-turn: the first turn is the request
    functions = record.get("function")
    if category.startswith("multi_turn"):
        functions = _multi_turn_functions(record, data_dir)
    if not functions:
        raise InvalidRequest("no tools")
    if not isinstance(functions, list):
        raise InvalidRequest(f"'function' is a {type(functions).__name__}, not a list")
    tools = [{"type": "function", "function": fn} for fn in functions]
    request = ToolRequest.from_dict(
        {"id": rid, "source": BFCL_SOURCE, "category": category, "messages": question, "tools": tools}
    )
    schemas = {fn["name"]: fn["parameters"] for fn in request.functions}
    reference = None
    if rid in answers:
        truth = answers[rid]
        if category.startswith("multi_turn"):
            reference = _calls_from_python(truth[0] if truth else [], schemas)
        else:
            reference = [ToolCall(name, _first_acceptable(args)) for entry in truth for name, args in entry.items()]
    elif isinstance(record.get("ground_truth"), (list, str)):
        truth = record["ground_truth"]
        reference = _calls_from_python([truth] if isinstance(truth, str) else truth, schemas)
    return ToolRequest(
        id=request.id, messages=request.messages, tools=request.tools, source=request.source,
        category=category, reference=reference,
    )


def _multi_turn_functions(record: dict, data_dir: Path) -> list[dict]:
    missed = {name for names in (record.get("missed_function") or {}).values() for name in names}
    functions = []
    for cls in record.get("involved_classes", []):
        doc = data_dir / "multi_turn_func_doc" / _MULTI_TURN_DOCS.get(cls, "")
        if not doc.is_file():
            raise InvalidRequest(f"no function doc for class {cls!r}")
        functions += [fn for _, fn in json_lines(doc)]
    return [fn for fn in functions if fn.get("name") not in missed]


def _first_acceptable(args: dict) -> dict:
    """BFCL lists acceptable values per field; keep the first, omit optional-empty fields."""
    out = {}
    for key, options in args.items():
        value = options[0] if isinstance(options, list) and options else options
        if value == "" or value is None:
            continue
        if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
            value = _first_acceptable(value)
        out[key] = value
    return out


def _calls_from_python(calls: list[str], schemas: dict[str, dict]) -> list[ToolCall] | None:
    """Parse ``f(a=1, b='x')`` strings; positional arguments follow the schema's key order.

    Returns None when any call is not a literal call (its reference is then unknown).
    """
    out = []
    for text in calls:
        try:
            node = ast.parse(text.strip(), mode="eval").body
            if not isinstance(node, ast.Call):
                return None
            name = ast.unparse(node.func)
            keys = list(schemas.get(name, {}).get("properties", {}))
            if len(node.args) > len(keys):
                return None
            arguments = {keys[i]: ast.literal_eval(arg) for i, arg in enumerate(node.args)}
            arguments.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg})
        except (SyntaxError, ValueError, TypeError):
            return None
        out.append(ToolCall(name, _jsonable(arguments)))
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------- Glaive
_ROLE_RE = re.compile(r"(?m)^\s*(SYSTEM|USER|ASSISTANT|FUNCTION RESPONSE):")  # roles open a line
_END_RE = re.compile(r"<\|endoftext\|>")


def load_glaive(source: str, split: str, log: RejectLog, limit: int | None = None) -> list[ToolRequest]:
    """Glaive function calling (v1 ``sample`` column or v2 ``system``/``chat`` columns).

    ``source`` is a hub id or a local path (a saved dataset folder or JSON/JSONL/Parquet file).
    """
    import datasets  # imported here: loading it is slow and only this loader needs it

    try:
        if Path(source).is_dir() and (Path(source) / "dataset_info.json").exists():
            ds = datasets.load_from_disk(source)
        elif Path(source).is_file():
            builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(Path(source).suffix, "json")
            ds = datasets.load_dataset(builder, data_files=source, split="train")
        else:
            ds = datasets.load_dataset(source, split=split)
    except Exception as e:  # noqa: BLE001 - offline hub failures come in many types
        raise RuntimeError(
            f"could not load Glaive from {source!r} ({type(e).__name__}: {e}). Offline, point "
            "data.glaive at a local copy (a `datasets` folder or a JSON/Parquet file), or set data.glaive=null."
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[split]
    out: list[ToolRequest] = []
    for row_index, row in enumerate(ds):
        if limit is not None and len(out) >= limit:
            break
        text = row.get("sample") or _v2_text(row.get("system") or "", row.get("chat") or "")
        rid = f"glaive_{row_index}"
        try:
            out += _glaive_requests(text, rid)
        except InvalidRequest as e:
            log.add(f"glaive:{source}", row_index + 1, rid, str(e))
    return out


def _v2_text(system: str, chat: str) -> str:
    """Glaive v2 splits a conversation into `system` (already "SYSTEM: ..."-prefixed) and `chat`."""
    system = system.strip()
    return f"{system if system.startswith('SYSTEM:') else 'SYSTEM: ' + system}\n{chat}"


def _glaive_requests(text: str, conversation_id: str) -> list[ToolRequest]:
    turns = _glaive_turns(text)
    if not turns or turns[0][0] != "SYSTEM":
        raise InvalidRequest("no SYSTEM turn")
    functions = _glaive_functions(turns[0][1])
    if not functions:
        raise InvalidRequest("no tools")
    tools = [{"type": "function", "function": fn} for fn in functions]
    messages: list[dict] = []
    out = []
    for role, content in turns[1:]:
        if role == "ASSISTANT" and "<functioncall>" in content:
            call = _glaive_call(content)
            if call is not None and any(m["role"] == "user" for m in messages):
                out.append(ToolRequest.from_dict({
                    "id": f"{conversation_id}_{len(out)}", "source": GLAIVE_SOURCE, "category": "glaive",
                    "messages": list(messages), "tools": tools, "reference": [call.to_dict()],
                    "meta": {"conversation": conversation_id},
                }))
            messages.append({"role": "assistant", "content": content})
        else:
            mapped = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}.get(role)
            if mapped is None:
                raise InvalidRequest(f"unexpected {role} turn inside the conversation")
            messages.append({"role": mapped, "content": content})
    if not out:
        raise InvalidRequest("no function call")
    return out


def _glaive_turns(text: str) -> list[tuple[str, str]]:
    parts = _ROLE_RE.split(text)
    return [(parts[i], _END_RE.sub("", parts[i + 1]).strip()) for i in range(1, len(parts) - 1, 2)]


def _glaive_functions(system: str) -> list[dict]:
    """The JSON function schemas embedded in Glaive's system text."""
    decoder = json.JSONDecoder()
    out, i = [], system.find("{")
    while 0 <= i < len(system):
        try:
            obj, end = decoder.raw_decode(system, i)
        except ValueError:
            i = system.find("{", i + 1)
            continue
        if isinstance(obj, dict) and "name" in obj:
            obj["parameters"] = schemas.normalize(obj.get("parameters", {"type": "object", "properties": {}}))
            out.append(obj)
        i = system.find("{", end)
    return out


def _glaive_call(content: str) -> ToolCall | None:
    """Glaive writes ``<functioncall> {"name": "f", "arguments": '{"a": 1}'}``: arguments quoted."""
    body = content.split("<functioncall>", 1)[1].strip()
    match = re.match(r'\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"arguments"\s*:\s*\'(.*)\'\s*\}\s*$', body, re.S)
    try:
        if match:
            return ToolCall(match.group(1), json.loads(match.group(2)))
        obj = json.loads(body)
        args = obj.get("arguments", {})
        return ToolCall(obj["name"], json.loads(args) if isinstance(args, str) else args)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
