"""Value guesses: literals a value nobody has prepared may turn out to be, ranked, for the
packer to chain through (``packer.propose_tagged``'s ``guessed``).

Pure (standard library only). A SIDE branch prepares a value with the target's own forwards;
where its rows do not pay (a CPU, whose rows cost milliseconds), a value's first token is
otherwise left to the head, and the round that writes it ends there. Two sources name
likely values for free:

* the **schema**: an ``enum``'s values and a boolean's two, the default first;
* the **request**: a number value is nearly always one the conversation wrote (a radius, an
  amount, a year), and calls write them in the order the request mentions them. Numbers are
  read as JSON writes them: thousands separators dropped (``$500,000`` -> ``500000``), a sign
  kept where it is one (``-74.0060``, not the dash of ``2018-2019``), a percentage also as
  its fraction.

A guess is only a draft: the target verifies every token, and how often each rank of guess
holds is learnt per launch like every other draft source (``pricing/acceptance.py``).
"""

from __future__ import annotations

import json
import re
from collections import Counter

# a number as prose writes it: digits with optional thousands separators and a fraction,
# a minus sign only where no word or digit runs into it
_NUMBER = re.compile(r"(?<![\w.])(-?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\d])")
# a number as a JSON value in a response: after a key's colon, an array's bracket or a comma
_WRITTEN = re.compile(r"(?<=[:\[,])\s*(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)")


def request_numbers(text: str) -> list[str]:
    """The numbers ``text`` holds, in order, as JSON literals (repeats kept); a percentage
    also as the fraction it stands for, after it (``7%`` -> ``7``, ``0.07``)."""
    out = []
    for m in _NUMBER.finditer(text):
        sign, whole, fraction = m.groups()
        out.append(sign + whole.replace(",", "") + (fraction or ""))
        if text[m.end():m.end() + 1] == "%":
            out.append(_fraction(out[-1]))
    return out


def _fraction(percent: str) -> str:
    """``percent`` / 100 as JSON writes it, digits shifted, not floats divided (``7`` -> ``0.07``)."""
    sign, digits = ("-", percent[1:]) if percent.startswith("-") else ("", percent)
    whole, _, frac = digits.partition(".")
    whole = whole.zfill(3)
    shifted = (whole[:-2].lstrip("0") or "0") + "." + whole[-2:] + frac
    return sign + (shifted.rstrip("0").rstrip(".") if "." in shifted else shifted)


def written_numbers(response: str) -> list[str]:
    """The number values a response has written so far (the one being written included)."""
    return _WRITTEN.findall(response)


def unused(candidates: list[str], used: list[str]) -> list[str]:
    """``candidates`` in order, each occurrence ``used`` accounts for removed once, then the
    repeats dropped: what the response has not written yet, first mention first."""
    left = Counter(used)
    out = []
    for c in candidates:
        if left[c]:
            left[c] -= 1
        elif c not in out:
            out.append(c)
    return out


def schema_choices(spec: object) -> tuple[str, ...]:
    """The literals a value of ``spec`` is one of, as JSON writes them: its ``enum``, a
    boolean's ``true``/``false``; its ``default`` first. () where the schema leaves it open."""
    if not isinstance(spec, dict):
        return ()
    if isinstance(spec.get("enum"), list):
        values = list(spec["enum"])
    elif spec.get("type") in ("boolean", "bool"):
        values = [True, False]
    else:
        return ()
    if "default" in spec and spec["default"] in values:
        values.remove(spec["default"])
        values.insert(0, spec["default"])
    return tuple(dict.fromkeys(json.dumps(v, ensure_ascii=False) for v in values))


def value_guesses(kind: str, choices: tuple[str, ...], numbers: list[str], response: str, most: int,
                  partial: str = "") -> list[str]:
    """Up to ``most`` literals for the value a ``response`` (the text before that value) writes
    next, best first: the schema's choices where it has them, else for a number the request's
    numbers the response has not written yet. ``partial``: what of the value is written (a
    guess goes on from it)."""
    if choices:
        pool = list(choices)
    elif kind == "number":
        pool = unused(numbers, written_numbers(response))
    else:
        return []
    return [g for g in pool if g.startswith(partial) and g != partial][:max(most, 0)]
