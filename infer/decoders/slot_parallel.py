"""SchemaFill: BM25 tool forecast, SIDE branches that prepare argument values, packing of
prepared values with structural text across fields and calls, one shared tree verification
per round (``slots/policy.py`` has the policy; ``slots/`` the machinery). ``schemafill``
runs at ``decode.ablation``; ``schemafill_A`` .. ``schemafill_D`` at that stage of the paper's
Table 2."""

from __future__ import annotations

from infer.decoders.context import DecoderContext
from infer.decoders.method import Method
from infer.pricing.budget import NodeBudget
from infer.proposers.head import HeadDrafter, HeadTimes
from infer.rounds.decoding import Runtime
from infer.slots.policy import SchemaFillConfig, SideLedger, SlotDrafting
from schemafill.runtime.drafter import Eagle3Head


def declare(rt: Runtime, head: Eagle3Head, cfg: SchemaFillConfig, budget: NodeBudget | None = None,
            ledger: SideLedger | None = None) -> Method:
    """``ledger``: what the launch has measured of SIDE rows so far (a fresh one by default)."""
    budget, ledger = budget or NodeBudget(), ledger or SideLedger()
    times = HeadTimes()  # the budget also prices the head's levels, by what they take here

    def drafting(request, prompt, groups=None, values=None):
        # SIDE drafts read the prompt's head entries: the head's first catch-up is never skipped
        drafter = HeadDrafter(head, cfg.budget, budget, times, prompt_first=cfg.sides)
        return SlotDrafting(cfg, drafter, budget, ledger, request, prompt, rt.tokenizer, rt.eos,
                            request.response_format(rt.fmt), groups, values)

    return Method(rt, drafting, budget)


def build(ctx: DecoderContext, method: str) -> Method:
    cfg = SchemaFillConfig.of(ctx.decode, ablation=method.partition("_")[2] or ctx.decode.ablation)
    return declare(ctx.runtime, ctx.head, cfg, ctx.budget())
