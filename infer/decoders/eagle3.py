"""EAGLE-3 tree speculation: the head drafts a dynamic tree each round, the target verifies it
in one call and keeps the longest greedy path plus its own next token. ``eagle3`` drafts at
the decode budget (cost-aware selection keeps what pays); ``eagle3_wide`` at EAGLE's
published defaults."""

from __future__ import annotations

from infer.decoders.context import DecoderContext
from infer.decoders.method import Method
from infer.pricing.budget import NodeBudget
from infer.proposers.head import EAGLE_DEFAULTS, HeadDrafter, HeadTimes, TreeBudget
from infer.rounds.decoding import Runtime
from infer.rounds.loop import Proposing
from schemafill.runtime.drafter import Eagle3Head


def declare(rt: Runtime, head: Eagle3Head, tree: TreeBudget, budget: NodeBudget | None = None) -> Method:
    times = HeadTimes()  # the budget also prices the head's levels, by what they take here
    return Method(rt, lambda request, prompt: Proposing(HeadDrafter(head, tree, budget, times), tree.total, budget),
                  budget)


def build(ctx: DecoderContext, method: str) -> Method:
    tree = TreeBudget.of(ctx.decode) if method == "eagle3" else EAGLE_DEFAULTS
    return declare(ctx.runtime, ctx.head, tree, ctx.budget())
