"""Explanations shown to people: tokens shaded by contribution, in a terminal or as HTML.

Both renderings scale each token's shade by ``|contribution| / max |contribution|`` of its
sequence, in five levels. Positive contributions (the token makes the document help the query)
are green, negative red; without colour the sign and level are written after the token
(``⟨word⟩+++``, ``⟨word⟩--``), so the two stay distinguishable in plain text and to screen readers.
"""

from __future__ import annotations

import html
from typing import List, Sequence

from eogp_index.search.explain import Explanation, TokenContribution

LEVELS = 4  # shades per sign; level 0 = too small to mark (under 1/8 of the largest)

_ANSI_BG = {1: ("22", "52"), 2: ("28", "88"), 3: ("34", "124"), 4: ("40", "160")}  # 256-colour: (green, red)


def _levels(tokens: Sequence[TokenContribution]) -> List[int]:
    """Signed level per token: ``sign · ceil(LEVELS · |c| / max|c|)``, 0 under an eighth of the max."""
    peak = max((abs(t.contribution) for t in tokens), default=0.0)
    out = []
    for t in tokens:
        share = abs(t.contribution) / peak if peak > 0 else 0.0
        level = 0 if share < 1 / 8 else min(LEVELS, max(1, round(share * LEVELS)))
        out.append(level if t.contribution >= 0 else -level)
    return out


def shade_terminal(tokens: Sequence[TokenContribution], *, color: bool = True) -> str:
    """One line of tokens shaded by contribution (ANSI backgrounds, or sign marks without colour)."""
    parts = []
    for token, level in zip(tokens, _levels(tokens)):
        text = token.token.replace("\n", "⏎")
        if level == 0:
            parts.append(text)
        elif color:
            green, red = _ANSI_BG[abs(level)]
            parts.append(f"\x1b[48;5;{green if level > 0 else red}m{text}\x1b[0m")
        else:
            parts.append(f"⟨{text}⟩{('+' if level > 0 else '-') * abs(level)}")
    return "".join(parts)


def explanation_terminal(explanation: Explanation, *, color: bool = True, width: int = 40) -> str:
    """A terminal rendering: scores, per-module bars, then the document's and the query's tokens."""
    e = explanation
    ranked = (
        "1-bit, as ranked" if e.score_1bit is None else f"rescored from the tier, as ranked; 1-bit {e.score_1bit:+.4e}"
    )
    lines = [f"{e.id}: score {e.score:+.4e} ({ranked}), {e.score_projected:+.4e} unquantized"]
    if e.checkpoints:  # an ensemble: each checkpoint's weighted share of the score
        lines.append("checkpoints (weighted shares of the score):")
        lines.extend(f"  {name}  {value:+.3e}" for name, value in e.checkpoints.items())
    peak = max((abs(v) for v in e.modules.values()), default=0.0) or 1.0
    name_width = max((len(n) for n in e.modules), default=0)
    for name, value in e.modules.items():
        bar = ("+" if value >= 0 else "-") * max(0, round(width * abs(value) / peak))
        lines.append(f"  {name:<{name_width}}  {value:+.3e}  {bar}")
    lines.append("document tokens:")
    lines.append("  " + shade_terminal(e.train_tokens, color=color))
    lines.append("query tokens:")
    lines.append("  " + shade_terminal(e.query_tokens, color=color))
    return "\n".join(lines)


def _html_tokens(tokens: Sequence[TokenContribution]) -> str:
    spans = []
    for token, level in zip(tokens, _levels(tokens)):
        alpha = abs(level) / LEVELS * 0.75
        rgb = "46, 160, 67" if level > 0 else "207, 34, 46"
        sign = "pos" if level > 0 else "neg" if level < 0 else "zero"
        style = f' style="background: rgba({rgb}, {alpha:.2f})"' if level else ""
        spans.append(
            f'<span class="eogp-token eogp-{sign}" data-contribution="{token.contribution:.6e}" '
            f'title="{token.contribution:+.3e}"{style}>{html.escape(token.token)}</span>'
        )
    return "".join(spans)


def explanation_html(explanation: Explanation) -> str:
    """An HTML fragment (no page, no script, no external asset) for a web page to embed.

    Tokens are ``<span class="eogp-token eogp-pos|eogp-neg|eogp-zero">`` with their contribution
    in ``data-contribution`` and ``title``; modules are rows of ``<div class="eogp-module">``
    with a bar whose width is the term's share of the largest.
    """
    e = explanation
    peak = max((abs(v) for v in e.modules.values()), default=0.0) or 1.0
    modules = "".join(
        f'<div class="eogp-module"><span class="eogp-module-name">{html.escape(name)}</span>'
        f'<span class="eogp-bar eogp-{"pos" if value >= 0 else "neg"}" '
        f'style="width: {100 * abs(value) / peak:.1f}%"></span>'
        f'<span class="eogp-module-value">{value:+.3e}</span></div>'
        for name, value in e.modules.items()
    )
    return (
        f'<div class="eogp-explanation" data-id="{html.escape(e.id)}">'
        f'<p class="eogp-scores">score {e.score:+.4e} (1-bit, as ranked) · '
        f"{e.score_projected:+.4e} unquantized</p>"
        + (
            '<div class="eogp-checkpoints">'
            + "".join(
                f'<div class="eogp-checkpoint"><span class="eogp-checkpoint-name">{html.escape(name)}</span>'
                f'<span class="eogp-checkpoint-value">{value:+.3e}</span></div>'
                for name, value in e.checkpoints.items()
            )
            + "</div>"
            if e.checkpoints
            else ""
        )
        + f'<div class="eogp-modules">{modules}</div>'
        f'<p class="eogp-label">document tokens</p><p class="eogp-tokens">{_html_tokens(e.train_tokens)}</p>'
        f'<p class="eogp-label">query tokens</p><p class="eogp-tokens">{_html_tokens(e.query_tokens)}</p>'
        "</div>"
    )
