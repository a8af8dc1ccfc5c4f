"""The regions of one request's target KV arena (row 0; docs/design.md, "SchemaFill, step by step":
KV); pure arithmetic.

* ``[0, P)`` the prompt, shared and read-only once written;
* ``[P, P + max_new_tokens]`` the committed response, in position order (accepted rows
  are moved down here);
* ``[P + max_new_tokens + 1, side_base)`` scratch for the MAIN tree under verification,
  overwritten next round;
* ``[side_base, capacity)`` a pool for SIDE rows, which SchemaFill allocates and frees
  (``infer/slots/side.py``); a SIDE row never moves into MAIN.

The head's arena mirrors it: its committed entries at the same positions, and SIDE
contexts' head entries at their target rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArenaLayout:
    prompt_len: int
    max_new_tokens: int
    scratch: int  # most MAIN tree nodes one verification may carry
    side_capacity: int = 0  # rows for SIDE branches

    @property
    def positions(self) -> int:
        """Most positions MAIN ever holds: the prompt, the response, one pending token."""
        return self.prompt_len + self.max_new_tokens + 1

    @property
    def side_base(self) -> int:
        return self.positions + self.scratch

    @property
    def capacity(self) -> int:
        return self.side_base + self.side_capacity
