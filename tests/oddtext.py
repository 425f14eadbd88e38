"""Generated odd text for the fuzzers: lone surrogates, NUL and non-characters at random places.

A plain module (``import oddtext``), like tinymodels.py. A lone UTF-16 surrogate is not Unicode
text (UTF-8 cannot encode it); NUL and the non-characters are valid, if unusual, and must be kept.
"""

from __future__ import annotations

import json
import random
from typing import Tuple


def odd_code_point(rng: random.Random) -> str:
    """A lone surrogate (half of the draws), NUL or a non-character of a random plane."""
    kind = rng.choice(["surrogate", "surrogate", "nul", "noncharacter"])
    if kind == "surrogate":
        return chr(rng.randrange(0xD800, 0xE000))
    if kind == "nul":
        return "\x00"
    plane = rng.randrange(17) << 16
    return chr(rng.choice([0xFDD0 + rng.randrange(32), plane | 0xFFFE, plane | 0xFFFF]))


def is_text(value: str) -> bool:
    """Whether ``value`` is Unicode text as a JSON reader sees it: two surrogates written side by
    side may make a valid pair, which JSON reads back as one character."""
    try:
        json.loads(json.dumps(value)).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def with_odd(rng: random.Random, text: str) -> Tuple[str, bool]:
    """``text`` with one to three odd code points put in at random places, and whether the result
    is invalid (not Unicode text)."""
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(len(text) + 1)
        text = text[:at] + odd_code_point(rng) + text[at:]
    return text, not is_text(text)
