"""Records and queries with a lone surrogate in one text field, generated from the record kinds.

Every kind of :data:`~eogp_index.data.records.RECORD_KINDS` with text fields, in each form its
fields allow (strings, or chats), with ``"\\ud800"`` in one string: a text field, or a message's
role or content. A new kind or text field is covered by being listed there.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from eogp_index.data.records import RECORD_KINDS

#: A lone surrogate inside otherwise valid text (what JSON's "\ud800" escape decodes to).
SURROGATE = "t1 \ud800 t2"
_WORDS = {"text": "t1 t2 t3", "prompt": "t1 t2", "completion": " t3 t4", "chosen": " t3 t4", "rejected": " t5 t6"}


def _chat(name: str) -> List[Dict[str, str]]:
    if name == "messages":
        return [{"role": "user", "content": "t1 t2"}, {"role": "assistant", "content": "t3 t4"}]
    return [{"role": "user" if name == "prompt" else "assistant", "content": _WORDS[name].strip()}]


def bad_records(*, documents: bool = False) -> List[Tuple[str, Dict[str, Any], str]]:
    """``(case, record, field)``: a record of each kind and form with a lone surrogate in one of
    its strings, and the record field that holds it. documents: only the kinds a corpus holds."""
    out = []
    for kind in RECORD_KINDS:
        if documents and kind.query_only:
            continue
        forms = [form for form, fields in (("text", kind.text_fields), ("chat", kind.chat_fields)) if fields]
        for form in forms:
            base = {name: (_WORDS[name] if form == "text" else _chat(name)) for name in kind.fields}
            for name in kind.fields:
                if form == "text":
                    out.append((f"{kind.name}:{name}", {**base, name: SURROGATE}, name))
                    continue
                for key in ("role", "content"):
                    chat = [dict(message) for message in base[name]]
                    chat[0][key] = SURROGATE
                    out.append((f"{kind.name}:{name}[0].{key}", {**base, name: chat}, name))
    return out
