"""Text to token ids where user text can never become a control token.

A tokenizer's special tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, ...) delimit the
turns of a chat. If user text -- a prompt, a document being summarised, a retrieved page --
were encoded with those strings parsed, it could open a system turn of its own (prompt
injection). Here:

* `encode_text` encodes text with every special token's spelling as ordinary text (the
  `tokenizers` backend's ``encode_special_tokens``), and checks that no special id came out;
* `render` renders a chat template with each message's content replaced by a sentinel, so the
  rendered prompt comes back as pieces that are either the template's own text (trusted) or
  a message's content (never parsed for special tokens);
* `encode_pieces` turns those pieces into ids: special ids only where a trusted piece spells
  them, and every run of text between two of them encoded as one text -- so a prompt whose
  contents hold no special spelling encodes exactly as before (the old encode of the whole
  rendered string), and a special spelling split across two pieces (context | question) stays
  text.

Used by `models.tokenizer.Tokenizer` (the CLI, `ask`, the eval harness) and by
`kvjax.tools.exported.TextCodec` (an exported artifact's tokenizer), which needs no `models`.

Example:
    >>> from tokenizers import Tokenizer, models
    >>> backend = Tokenizer(models.WordLevel({"a": 0, "<s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    >>> backend.add_special_tokens(["<s>"])
    1
    >>> encode_text(backend, "<s>")   # text (3 unknown characters), not the special id 1
    [2, 2, 2]
    >>> encode_pieces(backend, [("<s>", True), ("a", False)])
    [1, 0]
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Sequence

__all__ = ["encode_text", "encode_pieces", "render", "special_ids", "check_messages", "check_text",
           "token_id_lists"]

_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
_SENTINEL = "\ue000kvjax-content-{}-{}\ue001"
_SENTINEL_RE = re.compile("\ue000kvjax-content-(\\d+)-(\\d+)\ue001")


def special_ids(backend) -> dict[str, int]:
    """{spelling: id} of the backend's special (control) tokens."""
    return {tok.content: int(i) for i, tok in backend.get_added_tokens_decoder().items()
            if tok.special}


_PLAIN: dict[int, tuple[Any, Any, dict[str, int]]] = {}


def _plain(backend):
    """(copy of `backend` encoding special spellings as text, special ids), once per backend."""
    entry = _PLAIN.get(id(backend))
    if entry is None or entry[0] is not backend:
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(backend.to_str())
        plain.encode_special_tokens = True  # special spellings are ordinary text
        entry = _PLAIN[id(backend)] = (backend, plain, special_ids(backend))
    return entry[1], entry[2]


def check_text(text: Any, what: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, got {type(text).__name__} {text!r:.80}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates: bytes that were not UTF-8 (argv, files)
        raise ValueError(f"{what}: not valid Unicode text ({text[e.start:e.end]!r} at index "
                         f"{e.start}; was it read from bytes that are not UTF-8?)") from None
    return text


def encode_text(backend, text: str, *, what: str = "text") -> list[int]:
    """Ids of `text` with no special token parsed: `<|im_start|>` in it is text, never id 1.

    Where the vocabulary itself would still build a special id from plain text (a word-level
    vocabulary holding the spelling, or BPE merges that reach it), that token's text is
    encoded one character at a time instead; a special id left after that is a ValueError.
    """
    check_text(text, what)
    if not text:
        return []
    plain, specials = _plain(backend)
    specials = set(specials.values())
    encoding = plain.encode(text, add_special_tokens=False)
    if not specials.intersection(encoding.ids):
        return list(encoding.ids)
    out = []
    for token, (start, end) in zip(encoding.ids, encoding.offsets):
        if token not in specials:
            out.append(token)
            continue
        for ch in text[start:end]:
            out.extend(plain.encode(ch, add_special_tokens=False).ids)
    bad = sorted(specials.intersection(out))
    if bad:
        raise ValueError(f"{what}: the tokenizer builds special ids {bad} from single "
                         f"characters of plain text; refusing to encode it")
    return out


def encode_pieces(backend, pieces: Sequence[tuple[str, bool]]) -> list[int]:
    """Ids of `pieces` [(text, trusted)]: special ids only where a trusted piece spells one.

    Adjacent text -- within and across pieces -- is encoded as one run, as the whole string
    would be between its special tokens.
    """
    specials = _plain(backend)[1]
    pattern = (re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
               if specials else None)
    out: list[int] = []
    run: list[str] = []

    def flush():
        if run:
            out.extend(encode_text(backend, "".join(run)))
            run.clear()

    for text, trusted in pieces:
        check_text(text, "a prompt piece")
        if not trusted or pattern is None:
            run.append(text)
            continue
        at = 0
        for m in pattern.finditer(text):
            run.append(text[at:m.start()])
            flush()
            out.append(specials[m.group()])
            at = m.end()
        run.append(text[at:])
    flush()
    return out


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as a list of {"role": str, "content": str or [str, ...]}; TypeError otherwise."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                        f"got {type(messages).__name__} {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError(f"messages[{i}] must be a dict with a str 'role', got {m!r:.80}")
        # the role is rendered as template text (trusted): a plain word, never a spelling
        if not _ROLE.fullmatch(m["role"]):
            raise ValueError(f"messages[{i}]['role'] is {m['role']!r:.80}; a role is a plain "
                             f"word such as 'system', 'user', 'assistant' or 'tool'")
        if set(m) - {"role", "content"}:
            raise ValueError(f"messages[{i}] has keys {sorted(set(m) - {'role', 'content'})}; "
                             f"only 'role' and 'content' are rendered (anything else would "
                             f"reach the template as trusted text)")
        content = m.get("content")
        parts = content if isinstance(content, (list, tuple)) else [content]
        if not parts or not all(isinstance(p, str) for p in parts):
            raise TypeError(f"messages[{i}]['content'] must be a str (or a list of str), got "
                            f"{type(content).__name__} {content!r:.80}")
    return list(messages)


def render(template, messages, *, add_generation_prompt: bool = True,
           **variables) -> list[tuple[str, bool]]:
    """The chat prompt as pieces [(text, trusted)]: the template's text trusted, every
    message's content (a str, or a list of str parts rendered one after another) not.

    `template` is a compiled Jinja2 template. The pieces joined equal the template rendered
    with the real contents; a template that rewrites the content beyond stripping its ends
    (which is followed) is a ValueError, since its pieces would not be what the model sees.
    """
    messages = check_messages(messages)
    parts = [list(m["content"]) if isinstance(m["content"], (list, tuple)) else [m["content"]]
             for m in messages]
    real = template.render(messages=[{**m, "content": "".join(p)} for m, p in
                                     zip(messages, parts)],
                           add_generation_prompt=add_generation_prompt, **variables)
    marked = template.render(
        messages=[{**m, "content": "".join(_SENTINEL.format(i, j) for j in range(len(p)))}
                  for i, (m, p) in enumerate(zip(messages, parts))],
        add_generation_prompt=add_generation_prompt, **variables)
    for strip in (False, True):
        pieces, at = [], 0
        for match in _SENTINEL_RE.finditer(marked):
            pieces.append((marked[at:match.start()], True))
            i, j = int(match.group(1)), int(match.group(2))
            text = parts[i][j]
            if strip and j == 0:
                text = text.lstrip()
            if strip and j == len(parts[i]) - 1:
                text = text.rstrip()
            pieces.append((text, False))
            at = match.end()
        pieces.append((marked[at:], True))
        pieces = [(t, trusted) for t, trusted in pieces if t]
        if "".join(t for t, _ in pieces) == real:
            return pieces
    raise ValueError("the chat template rewrites message contents (beyond stripping their "
                     "ends); kvjax cannot tell its own text from the user's in it")


def tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None,
           sort_keys: bool = False) -> str:
    """Hugging Face's `tojson` filter (jinja2's own HTML-escapes '<', '>', '&')."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """A chat template compiled in a sandbox, with Hugging Face's environment settings."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def token_id_lists(prompts: Any, what: str = "prompts") -> list[list[int]]:
    """`prompts` (a list of token-id lists or 1-D integer arrays) as lists of Python ints.

    TypeError for a str or None where a list is expected, for a float id (never truncated:
    `2.7` is not token 2), a bool or a nested list; ValueError for an empty prompt.

    Example:
        >>> token_id_lists([[1, 2], (3,)])
        [[1, 2], [3]]
        >>> token_id_lists([[1, 2.5]])
        Traceback (most recent call last):
        ...
        TypeError: prompts[0]: token ids must be integers, got 2.5 (float) at index 1
    """
    import numpy as np

    if isinstance(prompts, (str, bytes)) or prompts is None or not hasattr(prompts, "__len__"):
        raise TypeError(f"{what} must be a list of token-id lists, got {type(prompts).__name__}"
                        f" {prompts!r:.80}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or p is None or not hasattr(p, "__len__"):
            raise TypeError(f"{what}[{i}] must be a list of token ids, got {type(p).__name__} "
                            f"{p!r:.80}" + (" (encode text with the tokenizer first)"
                                            if isinstance(p, str) else ""))
        ids = []
        for j, t in enumerate(p.tolist() if isinstance(p, np.ndarray) else p):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"{what}[{i}]: token ids must be integers, got {t!r} "
                                f"({type(t).__name__}) at index {j}")
            if not -2 ** 31 <= t < 2 ** 31:
                raise ValueError(f"{what}[{i}]: token id {t} at index {j} is out of the int32 "
                                 f"range (ids are in [0, vocabulary size))")
            ids.append(int(t))
        if not ids:
            raise ValueError(f"{what}[{i}]: every prompt needs at least one token")
        out.append(ids)
    return out
