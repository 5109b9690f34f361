"""Top-level editing of text-format ServerConfig files without the protobuf runtime.

A policy is a base config (model, inner optimizer, corpus: deploy/configs/sim-small.textproto)
with some top-level fields replaced (aggregation, outer_optimizer, local_work, penalty, ...).
Text format rejects a singular field given twice, so fields are replaced, never appended.
Only the top level is parsed: `name: value` and `name { ... }` entries, '#' comments; nested
messages are kept verbatim. aloe-sim / aloe-server validate the result.
"""

import re

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _strip_comments(text):
    out = []
    for line in text.splitlines():
        in_string = None
        cut = len(line)
        for i, ch in enumerate(line):
            if in_string:
                if ch == in_string and line[i - 1] != "\\":
                    in_string = None
            elif ch in "\"'":
                in_string = ch
            elif ch == "#":
                cut = i
                break
        out.append(line[:cut])
    return "\n".join(out)


def parse_top_level(text):
    """Returns an ordered list of (name, raw_entry) for the top-level fields of `text`.

    raw_entry is the entry's text without its name ("{ ... }" for a message, ": value" for a
    scalar). Raises ValueError naming the position of anything it does not understand.
    """
    text = _strip_comments(text)
    entries = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,;":
            i += 1
        if i >= n:
            return entries
        m = _NAME.match(text, i)
        if not m:
            raise ValueError(f"textproto: expected a field name at offset {i}: {text[i:i + 20]!r}")
        name = m.group(0)
        i = m.end()
        while i < n and text[i] in " \t":
            i += 1
        if i < n and text[i] == ":":
            j = i + 1
            while j < n and text[j] in " \t":
                j += 1
            if j < n and text[j] == "{":
                i = j
        start = i
        if i < n and text[i] == "{":
            depth, in_string = 0, None
            while i < n:
                ch = text[i]
                if in_string:
                    if ch == in_string and text[i - 1] != "\\":
                        in_string = None
                elif ch in "\"'":
                    in_string = ch
                elif ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                    if depth == 0:
                        i += 1
                        break
                i += 1
            if depth != 0:
                raise ValueError(f"textproto: unbalanced braces in field {name}")
        elif i < n and text[i] == ":":
            i += 1
            while i < n and text[i] in " \t":
                i += 1
            if i < n and text[i] in "\"'":
                quote = text[i]
                i += 1
                while i < n and not (text[i] == quote and text[i - 1] != "\\"):
                    i += 1
                i += 1
            else:
                while i < n and text[i] not in " \t\r\n,;":
                    i += 1
        else:
            raise ValueError(f"textproto: field {name} has neither ':' nor '{{'")
        entries.append((name, text[start:i].strip()))


def merge(base_text, overrides, header=""):
    """Returns `base_text` with the top-level fields in `overrides` (name -> raw entry, or None
    to delete the field) replaced in place or appended, in text format, after `header`
    comment lines."""
    entries = parse_top_level(base_text)
    seen = set()
    out = []
    for name, raw in entries:
        if name in overrides:
            if name in seen:
                continue
            seen.add(name)
            raw = overrides[name]
            if raw is None:
                continue
        out.append((name, raw))
    for name, raw in overrides.items():
        if name not in seen and raw is not None:
            out.append((name, raw))
    lines = [f"# {h}" for h in header.splitlines()] if header else []
    for name, raw in out:
        lines.append(f"{name} {raw}" if raw.startswith("{") else f"{name}{raw}")
    return "\n".join(lines) + "\n"


def field(text, name):
    """The raw entry of top-level field `name` in `text`, or None."""
    for n, raw in parse_top_level(text):
        if n == name:
            return raw
    return None


def scalar(raw_message, name, default=None):
    """Value of scalar `name` directly inside the message entry `raw_message` ("{ a: 1 ... }"),
    as a string, or `default`. Nested messages are skipped."""
    if raw_message is None:
        return default
    inner = raw_message.strip()
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1]
    for n, raw in parse_top_level(inner):
        if n == name and raw.startswith(":"):
            return raw[1:].strip().strip("\"'")
    return default
