"""Llama-family tokenizers (byte-level BPE and SentencePiece), built on `tokenizers`.

Two sources are supported, both producing the same `Tokenizer` wrapper:

* a GGUF file: the vocabulary, merges, special tokens and chat template are
  read from its metadata (``tokenizer.ggml.*``) with ``gguf.GGUFReader`` and a
  ``tokenizers.Tokenizer`` is assembled from them;
* a Hugging Face directory holding ``tokenizer.json`` (and optionally
  ``tokenizer_config.json`` / ``chat_template.jinja``).

Example::

    tok = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = tok.encode("Hello world")          # [19556, 905]
    tok.decode(ids)                          # 'Hello world'
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])

A GGUF vocabulary is byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM2,
Llama 3, Qwen) or SentencePiece BPE (``"llama"``: Gemma 3, Phi-3, Llama 2; pieces with
scores, byte fallback; `_build_sentencepiece`); another model raises a ``ValueError``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["Tokenizer", "load_tokenizer"]

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2  # SentencePiece's <unk>
TOKEN_TYPE_CONTROL = 3  # special tokens: <|im_start|>, <|endoftext|>, ...
TOKEN_TYPE_USER_DEFINED = 4  # added tokens matched whole, but not "special"

GGUF_MAGIC = b"GGUF"

# Split regexes of the pre-tokenizers that are not plain GPT-2 ByteLevel
# (copied from the models' own tokenizer.json files).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ----------------------------------------------------------------------------
# The wrapper
# ----------------------------------------------------------------------------


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's special ids and chat template.

    Attributes:
      backend: the wrapped ``tokenizers.Tokenizer`` (e.g. ``backend.save(path)``
        writes a ``tokenizer.json``).
      bos_id, eos_id, pad_id: special token ids, or None when unknown.
      chat_template: Jinja2 chat template source, or None.
      vocab_size: number of ids, added tokens included (49152 for SmolLM2).

    Example::

        tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
        tok.encode("12")                     # [33, 34]: digits split one by one
        tok.encode("<|im_start|>")           # ordinary text: never the control id 1
        tok.encode_chat([{"role": "user", "content": "Hi"}])  # control ids from the template
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` that `from_hf_dir` reads back."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        token = lambda i: None if i is None else self.backend.id_to_token(i)
        config = {"bos_token": token(self.bos_id), "eos_token": token(self.eos_id),
                  "pad_token": token(self.pad_id), "chat_template": self.chat_template}
        (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )

    # -- constructors --------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike | gguf.GGUFReader) -> "Tokenizer":
        """Builds the tokenizer from a GGUF file's ``tokenizer.*`` metadata.

        `path` may also be an open ``gguf.GGUFReader``: parsing the metadata
        takes seconds (98k strings for SmolLM2), so a weight loader that
        already has a reader can share it.

        Example::

            tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
            tok.bos_id, tok.eos_id                # (1, 2)
        """
        if isinstance(path, gguf.GGUFReader):
            reader = path
            path = Path(getattr(reader.data, "filename", None) or "<GGUFReader>")
        else:
            path = Path(path)
            _check_gguf_file(path)
            reader = gguf.GGUFReader(path)
        meta = _read_tokenizer_metadata(reader)

        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ValueError(
                f"{path}: tokenizer.ggml.model={kind!r} is unsupported; kvjax reads "
                "byte-level BPE ('gpt2') and SentencePiece BPE ('llama')."
            )
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type")  # int32[vocab] or None
        if kind == "llama":
            if "tokenizer.ggml.scores" not in meta:
                raise ValueError(f"{path}: a SentencePiece vocabulary needs "
                                 f"tokenizer.ggml.scores")
            backend = _build_sentencepiece(tokens, meta["tokenizer.ggml.scores"], types,
                                           bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        else:
            backend = _build_bpe(tokens, meta.get("tokenizer.ggml.merges", []),
                                 meta.get("tokenizer.ggml.pre", "default"))
        _register_added_tokens(backend, tokens, types)
        return cls(
            backend,
            bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            pad_id=_opt_int(meta.get("tokenizer.ggml.padding_token_id")),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Loads ``tokenizer.json`` (+ ``tokenizer_config.json``) from a directory.

        ``tokenizer_config.json`` supplies ``chat_template`` and the
        ``bos_token`` / ``eos_token`` / ``pad_token`` strings; a separate
        ``chat_template.jinja`` file is used when the config has no template.

        Example::

            tok = Tokenizer.from_hf_dir("checkpoints/SmolLM2-135M-Instruct")
        """
        path = Path(path)
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in this directory")
        backend = _HFTokenizer.from_file(str(tokenizer_json))

        config = _read_json(path / "tokenizer_config.json")
        template = _hf_chat_template(config.get("chat_template"))
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            bos_id=_hf_token_id(backend, config, "bos_token"),
            eos_id=_hf_token_id(backend, config, "eos_token"),
            pad_id=_hf_token_id(backend, config, "pad_token"),
            chat_template=template,
        )

    # -- encoding / decoding -------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, *, allow_special: bool = False
               ) -> list[int]:
        """Text -> ids (int[n]). User text: a special token's spelling in `text` is encoded
        as ordinary text, never as its control id (so a prompt or a document cannot open a
        chat turn of its own). Chat prompts come from `encode_chat`, whose template alone
        inserts control ids. `allow_special=True` is the explicit opt-in for trusted text
        that spells them (or pass token ids directly).

        Example::

            tok.encode("<|im_start|>user")                      # 'user' after 6 text ids
            tok.encode("<|im_start|>user", allow_special=True)  # [1, 4093]
            tok.encode("Hi", add_bos=True)                      # [tok.bos_id, ...]
        """
        from kvjax.tools.chat import check_text, encode_text

        check_text(text, "encode: text")  # TypeError for a non-str, ValueError for bad Unicode
        if allow_special:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        else:
            ids = encode_text(self.backend, text)
        return self._maybe_bos(ids, add_bos)

    def encode_batch(self, texts: Iterable[str], add_bos: bool = False, *,
                     allow_special: bool = False) -> list[list[int]]:
        """[text] -> [ids]; a ragged list (no padding), one list per text (as `encode`)."""
        if isinstance(texts, str):
            raise TypeError(f"encode_batch: texts must be a list of str, got a str "
                            f"{texts!r:.80} (use encode for one text)")
        return [self.encode(t, add_bos, allow_special=allow_special) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """ids (int[n], list or 1-D array) -> text.

        Example::

            tok.decode([1, 4093])                              # 'user'
            tok.decode([1, 4093], skip_special_tokens=False)   # '<|im_start|>user'
        """
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def _maybe_bos(self, ids: list[int], add_bos: bool) -> list[int]:
        if not add_bos:
            return list(ids)
        if self.bos_id is None:
            raise ValueError("add_bos=True but this tokenizer has no bos_id")
        return [self.bos_id, *ids]

    # -- chat ----------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}]) to a prompt string (to show).

        The template is rendered the way Hugging Face does (sandboxed Jinja2,
        ``trim_blocks``/``lstrip_blocks``). To get ids, call `encode_chat` (not `encode` of
        this string): it inserts control ids only where the template puts them.

        Example (SmolLM2, no system message -> the template adds its default)::

            tok.apply_chat_template([{"role": "user", "content": "Hi"}])
            # '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM,
            #  trained by Hugging Face<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>
            #  \\n<|im_start|>assistant\\n'
        """
        return "".join(t for t, _ in self.chat_pieces(messages, add_generation_prompt))

    def chat_pieces(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
                    ) -> list[tuple[str, bool]]:
        """The rendered chat prompt as [(text, trusted)]: the template's own text trusted,
        message contents (a str, or a list of str parts) not (`kvjax.tools.chat.render`)."""
        from kvjax.tools.chat import compile_template, render

        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return render(compile_template(self.chat_template), messages,
                      add_generation_prompt=add_generation_prompt,
                      bos_token=self._token_str(self.bos_id),
                      eos_token=self._token_str(self.eos_id),
                      pad_token=self._token_str(self.pad_id))

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """Ids of [(text, trusted)] pieces: control ids only where a trusted piece spells one
        (`kvjax.tools.chat.encode_pieces`)."""
        from kvjax.tools.chat import encode_pieces

        return encode_pieces(self.backend, pieces)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    *, suffix: str = "") -> list[int]:
        """Ids of the chat prompt (plus `suffix`, e.g. an answer prefix, as user text).

        The template's control tokens become their ids; a message content that spells one
        (``"<|im_end|>\\n<|im_start|>system..."``) stays ordinary text.

        Example::

            tok.encode_chat([{"role": "user", "content": "Hi"}])   # [1, 9690, ...]
        """
        return self.encode_pieces([*self.chat_pieces(messages, add_generation_prompt),
                                   (suffix, False)])

    def _token_str(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.backend.id_to_token(token_id) or ""


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Loads a tokenizer from a GGUF file or a Hugging Face directory.

    Also accepts the path of a ``tokenizer.json`` file (its directory is used).

    Example::

        tok = load_tokenizer(os.environ["KVJAX_SMOLLM2"])
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if path.name == "tokenizer.json":
        return Tokenizer.from_hf_dir(path.parent)
    if _has_gguf_magic(path):
        return Tokenizer.from_gguf(path)
    raise ValueError(
        f"{path}: not a GGUF file (no 'GGUF' magic) nor a directory with tokenizer.json"
    )


# ----------------------------------------------------------------------------
# GGUF metadata
# ----------------------------------------------------------------------------


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not _has_gguf_magic(path):
        raise ValueError(f"{path}: not a GGUF file (no 'GGUF' magic)")


def _read_tokenizer_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All ``tokenizer.*`` fields as Python values (str, int, list, int array)."""
    return {
        name: _field_value(field)
        for name, field in reader.fields.items()
        if name.startswith("tokenizer.")
    }


def _field_value(field: gguf.ReaderField) -> Any:
    """Decodes one GGUF metadata field.

    `field.parts` holds every raw piece of the record (name, type tags, lengths,
    payloads); `field.data` indexes the payload pieces: one per array element,
    or a single one for a scalar. Strings are uint8 arrays of UTF-8.
    """
    types = field.types
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [_decode_str(field.parts[i]) for i in field.data]  # list[str]
        if not field.data:
            return np.zeros((0,), dtype=np.int64)
        return np.concatenate([field.parts[i] for i in field.data])  # [n] numbers
    payload = field.parts[field.data[0]]
    if types[0] == gguf.GGUFValueType.STRING:
        return _decode_str(payload)
    return payload[0].item()  # int / float / bool


def _decode_str(raw: np.ndarray) -> str:
    return bytes(raw).decode("utf-8")


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


# ----------------------------------------------------------------------------
# Building a byte-level BPE `tokenizers.Tokenizer`
# ----------------------------------------------------------------------------


def _build_bpe(tokens: list[str], merges: list[str], pre: str) -> _HFTokenizer:
    """BPE model + pre-tokenizer + ByteLevel decoder from GGUF vocab/merges."""
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # keep the first id if a string repeats
    pre_tokenizer, ignore_merges = _pre_tokenizer(pre)
    model = models.BPE(
        vocab=vocab,
        merges=[_split_merge(m) for m in merges],
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=ignore_merges,
    )
    backend = _HFTokenizer(model)
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()  # as in Qwen2's tokenizer.json
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def _build_sentencepiece(tokens: list[str], scores, types, add_space_prefix: bool
                         ) -> _HFTokenizer:
    """A SentencePiece BPE vocabulary (pieces, scores) as a `tokenizers` BPE model.

    SentencePiece merges, again and again, the adjacent pair whose concatenation is a piece
    with the highest score; a character with no piece becomes its UTF-8 bytes (`<0xNN>`).
    The same as ranked merges: every split (left, right) of a piece into two pieces is a
    merge, ranked by the piece's score (highest first), with byte fallback. Spaces are
    SentencePiece's "▁", with one in front of the text when `add_space_prefix` (Llama 2,
    Phi-3; not Gemma 3), dropped again on decode; text on each side of an added token is
    prefixed on its own, as llama.cpp does.
    """
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    scores = np.asarray(scores, np.float64)
    types = np.ones(len(tokens), np.int32) if types is None else np.asarray(types)
    mergeable = [i for i in range(len(tokens))
                 if types[i] == TOKEN_TYPE_NORMAL and len(tokens[i]) > 1]
    merges = []
    for i in sorted(mergeable, key=lambda i: (-scores[i], i)):
        piece = tokens[i]
        merges += [(piece[:k], piece[k:]) for k in range(1, len(piece))
                   if piece[:k] in vocab and piece[k:] in vocab]
    unknown = [tokens[i] for i in np.flatnonzero(types == TOKEN_TYPE_UNKNOWN)]
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                                      fuse_unk=True, unk_token=unknown[0] if unknown else None))
    # spaces become "▁", and each stretch of text between added tokens gets the prefix, as
    # llama.cpp and transformers' fast Llama tokenizer give it (sentencepiece itself only
    # prefixes the whole text)
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPACE)] if add_space_prefix else [])
        + [normalizers.Replace(" ", SPACE)])
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return backend


def _split_merge(merge: str) -> tuple[str, str]:
    """'Ġ t' -> ('Ġ', 't'). Searches from index 1, as llama.cpp does."""
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ValueError(f"malformed BPE merge (no space): {merge!r}")
    return merge[:cut], merge[cut + 1 :]


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """Maps ``tokenizer.ggml.pre`` to (pre-tokenizer, BPE ignore_merges).

    * "gpt-2", "default": GPT-2 ByteLevel regex split.
    * "smollm": each digit on its own first, then GPT-2 ByteLevel (as in
      SmolLM2's tokenizer.json; "12345" -> 5 tokens).
    * "llama-bpe", "llama3": Llama-3 regex (digits in runs of <= 3), and BPE
      with ignore_merges (a word found in the vocab is taken whole).
    * "qwen2": Qwen2 regex (single digits); `_build_bpe` adds NFC.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt-2", "default"):
        return byte_level, False
    if pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level]), False
    if pre in ("llama-bpe", "llama3"):
        return _regex_then_bytes(_LLAMA3_PATTERN), True
    if pre == "qwen2":
        return _regex_then_bytes(_QWEN2_PATTERN), False
    raise ValueError(
        f"unsupported tokenizer.ggml.pre={pre!r}; known: gpt-2, default, "
        "smollm, llama-bpe, llama3, qwen2"
    )


def _regex_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([split, byte_level])


def _register_added_tokens(
    backend: _HFTokenizer, tokens: list[str], types: np.ndarray | None
) -> None:
    """CONTROL tokens become special tokens, USER_DEFINED ones added tokens.

    Both are then matched whole in input text; only special ones are dropped
    by ``decode(skip_special_tokens=True)``.
    """
    if types is None:
        return
    control = [tokens[i] for i in np.flatnonzero(types == TOKEN_TYPE_CONTROL)]
    user = [tokens[i] for i in np.flatnonzero(types == TOKEN_TYPE_USER_DEFINED)]
    backend.add_special_tokens([_added(t, special=True) for t in control])
    backend.add_tokens([_added(t, special=False) for t in user])


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


# ----------------------------------------------------------------------------
# Hugging Face directory helpers
# ----------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _hf_token_id(backend: _HFTokenizer, config: dict[str, Any], key: str) -> int | None:
    """Id of ``config[key]`` (a string or ``{"content": ...}``), None if unset."""
    token = config.get(key)
    if isinstance(token, dict):
        token = token.get("content")
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"tokenizer_config.json: {key}={token!r} is not in the vocabulary")
    return token_id


def _hf_chat_template(value: Any) -> str | None:
    """A template string, or the "default" one of a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    named = {t["name"]: t["template"] for t in value}
    return named.get("default")


# ----------------------------------------------------------------------------
# Chat templates
# ----------------------------------------------------------------------------


def _compile_chat_template(source: str):
    """Compiles a chat template in a sandbox, with HF's environment settings."""
    from kvjax.tools.chat import compile_template

    return compile_template(source)
