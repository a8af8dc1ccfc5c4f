"""Decoders: each turns one prompt into the target's greedy response, counting target calls.

Every decoder here is lossless at temperature 0 (DESIGN §3): its tokens equal AR's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Decoded:
    ids: list[int]  # response tokens
    text: str
    stop: str  # closed | eos | length
    target_calls: int  # prefill counts as one
    nodes: list[int] = field(default_factory=list)  # draft nodes per verification
    init_nodes: int = 0  # tree nodes verified with the prompt (SchemaFill's initialisation)
    times: dict[str, float] = field(default_factory=dict)  # seconds by phase, where a decoder splits them
    kv_rows: int = 0  # peak target KV rows holding live data (prompt, committed, tree, SIDE); 0 = not measured
    forced: int = 0  # response tokens the grammar forced (decode.constrain=schema): no target decision
    pruned: int = 0  # draft nodes the grammar ruled out before verification
