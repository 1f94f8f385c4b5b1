"""Tests for models.tokenizer.

Two groups:
* synthetic: tiny GGUF files written with gguf.GGUFWriter (always run); they
  pin the pre-tokenizer choice, special-token handling and error messages;
* real: the SmolLM2-135M-Instruct GGUF (conftest's `smollm2_file` fetches it once;
  KVJAX_SMOLLM2 may point at a local copy).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from models.tokenizer import Tokenizer, load_tokenizer


SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

PROSE = (
    "It was the best of times, it was the worst of times; it was the age of "
    "wisdom\u2014and, in 1859, the age of foolishness!\n\n"
    "  \u201cCaf\u00e9 na\u00efve r\u00e9sum\u00e9?\u201d she asked. "
    "Prices rose 3.75% (from $12,000 to $12,450) on 2024-03-15.\n"
    "\tTabs,  double  spaces, emoji \U0001F642, CJK \u6f22\u5b57, Greek \u03b1\u03b2\u03b3.\r\n"
    "def f(x): return x ** 2  # code too\n"
)


# ----------------------------------------------------------------------------
# Synthetic GGUF files
# ----------------------------------------------------------------------------

CONTROL, USER_DEFINED, NORMAL = 3, 4, 1
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
USER_TOKEN = "<tool>"  # id 3
BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
MERGES = ["1 2", "Ġ t", "a b"]  # -> "12", "Ġt", "ab"
EXTRA = ["12", "Ġt", "ab", "xyz"]  # "xyz" has no merges leading to it


def write_gguf(
    path: Path,
    *,
    model: str = "gpt2",
    pre: str | None = "gpt-2",
    chat_template: str | None = None,
) -> Path:
    """Writes a metadata-only GGUF file with a tiny byte-level BPE vocab."""
    tokens = SPECIALS + [USER_TOKEN] + BYTES + EXTRA
    types = [CONTROL] * 3 + [USER_DEFINED] + [NORMAL] * (len(BYTES) + len(EXTRA))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tokens_of(tok: Tokenizer, text: str) -> list[str]:
    return [tok.backend.id_to_token(i) for i in tok.encode(text)]


@pytest.mark.parametrize(
    "pre, expected",
    [
        ("gpt-2", ["12", "Ġ", "12"]),  # " ?\p{N}+": "Ġ12" -> "Ġ" + "12"
        ("default", ["12", "Ġ", "12"]),
        ("smollm", ["1", "2", "Ġ", "1", "2"]),  # digits split one by one first
        ("llama-bpe", ["12", "Ġ", "12"]),  # \p{N}{1,3}
        ("qwen2", ["1", "2", "Ġ", "1", "2"]),  # \p{N}
    ],
)
def test_pre_tokenizer_digits(tmp_path, pre, expected):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", pre=pre))
    assert tokens_of(tok, "12 12") == expected
    assert tok.decode(tok.encode("12 12")) == "12 12"


def test_llama3_ignores_merges_for_whole_vocab_words(tmp_path):
    # Only llama-bpe takes a word found in the vocab whole, without merges
    # (llama.cpp and Llama-3's tokenizer.json both set ignore_merges).
    gpt2 = Tokenizer.from_gguf(write_gguf(tmp_path / "a.gguf", pre="gpt-2"))
    llama3 = Tokenizer.from_gguf(write_gguf(tmp_path / "b.gguf", pre="llama-bpe"))
    assert tokens_of(gpt2, "xyz") == ["x", "y", "z"]
    assert tokens_of(llama3, "xyz") == ["xyz"]
    assert tokens_of(gpt2, " tab") == tokens_of(llama3, " tab") == ["Ġt", "ab"]


def test_qwen2_normalizes_to_nfc(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", pre="qwen2"))
    assert tok.encode("e\u0301") == tok.encode("\u00e9")  # decomposed é -> é


def test_from_gguf_accepts_an_open_reader(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", pre="smollm")
    from_reader = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert from_reader.encode("12 ab") == Tokenizer.from_gguf(path).encode("12 ab")


def test_missing_pre_means_default(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", pre=None))
    assert tokens_of(tok, "12") == ["12"]


def test_metadata_read_back(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf"))
    expected = SPECIALS + [USER_TOKEN] + BYTES + EXTRA
    assert tok.vocab_size == len(expected)
    assert [tok.backend.id_to_token(i) for i in range(len(expected))] == expected
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)
    assert tok.chat_template is None


def test_control_and_user_defined_tokens(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf"))
    ids = tok.encode("<|im_start|>ab<tool><|im_end|>", allow_special=True)  # trusted text
    assert ids[0] == 1 and ids[-1] == 2 and 3 in ids
    # Control tokens are dropped by default; user-defined ones are text.
    assert tok.decode(ids) == "ab<tool>"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>ab<tool><|im_end|>"


def test_add_bos_and_batch(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf"))
    texts = ["12 ab", "", "<|im_end|>"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts, add_bos=True) == [[1] + tok.encode(t) for t in texts]
    tok.bos_id = None
    with pytest.raises(ValueError, match="bos_id"):
        tok.encode("x", add_bos=True)


def test_unknown_pre_is_rejected(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", pre="deepseek-coder")
    with pytest.raises(ValueError, match="deepseek-coder"):
        Tokenizer.from_gguf(path)


def test_unknown_tokenizer_model_is_rejected(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", model="rwkv")
    with pytest.raises(ValueError, match="'rwkv' is unsupported"):
        load_tokenizer(path)


def test_sentencepiece_without_scores_is_rejected(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", model="llama")
    with pytest.raises(ValueError, match="needs tokenizer.ggml.scores"):
        load_tokenizer(path)


@pytest.fixture(scope="module", params=[True, False], ids=["space_prefix", "no_prefix"])
def sentencepiece_pair(request, tmp_path_factory):
    """(sentencepiece processor, kvjax Tokenizer of the GGUF llama.cpp would write for it):
    a 600-piece SentencePiece BPE model trained here on the KJV Genesis text with byte
    fallback and no normalization (Llama 2's settings); with and without the space prefix
    (Phi-3 / Llama 2 have it, Gemma 3 not)."""
    import sentencepiece as spm  # the test extra's reference

    folder = tmp_path_factory.mktemp("spm")
    text = (Path(__file__).parents[1] / "experiments" / "data" / "kjv_genesis.txt").read_text()
    (folder / "train.txt").write_text(text[:200_000], encoding="utf-8")
    prefix = request.param
    spm.SentencePieceTrainer.train(
        input=str(folder / "train.txt"), model_prefix=str(folder / "m"), vocab_size=600,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=prefix, character_coverage=1.0,
        user_defined_symbols=["<tool>"], minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "m.model"))
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
             else 5 if sp.is_unused(i) else 4 if sp.id_to_piece(i) == "<tool>" else 1
             for i in range(sp.get_piece_size())]  # llama.cpp's _create_vocab_sentencepiece
    writer = gguf.GGUFWriter(folder / "m.gguf", "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types(types)
    writer.add_add_space_prefix(prefix)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sp, Tokenizer.from_gguf(folder / "m.gguf")


SENTENCEPIECE_TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "  two leading spaces,   three inside, a trailing one ",
    "lines\nand\n\nparagraphs\twith a tab",
    PROSE,  # accents, emoji, CJK, Greek: no pieces for them, so bytes
    "begat begat begat Methuselah and Lamech",
]


@pytest.mark.parametrize("text", SENTENCEPIECE_TEXTS)
def test_sentencepiece_gguf_encodes_as_sentencepiece(sentencepiece_pair, text):
    """A SentencePiece GGUF vocabulary (`tokenizer.ggml.model == "llama"`, pieces, scores and
    types) encodes every text to the ids the sentencepiece library gives, and decodes back to
    the text."""
    sp, tok = sentencepiece_pair
    assert tok.encode(text) == sp.encode(text)
    assert tok.decode(tok.encode(text)) == text == sp.decode(sp.encode(text))


def test_sentencepiece_gguf_encodes_each_side_of_an_added_token_as_llama_cpp(sentencepiece_pair):
    """A user-defined piece in the text is matched whole, and the text on each side of it is
    encoded as a text of its own, space prefix included: llama.cpp's rule (and transformers'
    fast Llama tokenizer's); sentencepiece itself prefixes the whole text once."""
    sp, tok = sentencepiece_pair
    tool = sp.piece_to_id("<tool>")
    assert tok.encode("a <tool> call") == sp.encode("a ") + [tool] + sp.encode(" call")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_sentencepiece_gguf_equals_sentencepiece_on_random_text(sentencepiece_pair, text):
    sp, tok = sentencepiece_pair
    assert tok.encode(text) == sp.encode(text), text


def test_chat_template_rendering(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\n"
        "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", chat_template=template))
    msgs = [{"role": "user", "content": "Hi"}]
    # trim_blocks drops the newline after each block tag.
    assert tok.apply_chat_template(msgs) == "<|im_start|>[user] Hi<|im_end|>\n[assistant]"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|im_end|>\n")
    with pytest.raises(Exception, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_chat_template_is_an_error(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf"))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)  # a directory without tokenizer.json
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer(junk)
    with pytest.raises(ValueError, match="not a GGUF file"):
        Tokenizer.from_gguf(junk)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")


# ----------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct tokenizer
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_file) -> Tokenizer:
    return load_tokenizer(smollm2_file)  # ~5 s: GGUFReader parses 98k strings


def test_smollm2_metadata(smol):
    assert smol.vocab_size == 49152
    assert (smol.bos_id, smol.eos_id, smol.pad_id) == (1, 2, 2)
    assert smol.backend.token_to_id("<|endoftext|>") == 0


@pytest.mark.parametrize("text, token_id", [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)])
def test_smollm2_special_tokens_are_single_ids(smol, text, token_id):
    assert smol.encode(text, allow_special=True) == [token_id]
    assert smol.encode(f"a{text}b", allow_special=True)[1] == token_id
    assert token_id not in smol.encode(f"a{text}b")  # user text: never the control id
    assert smol.decode([token_id]) == ""
    assert smol.decode([token_id], skip_special_tokens=False) == text


def test_smollm2_digits_split_individually(smol):
    ids = smol.encode("12345")
    assert len(ids) == 5
    assert [smol.decode([i]) for i in ids] == list("12345")
    # The split happens in the pre-tokenizer (as in SmolLM2's tokenizer.json),
    # not only because the vocab lacks multi-digit tokens.
    pieces = smol.backend.pre_tokenizer.pre_tokenize_str("x 2024")
    assert [p for p, _ in pieces] == ["x", "Ġ", "2", "0", "2", "4"]
    # Where the digit split changes ids even with this vocab: whitespace before
    # a digit is cut off first, so "  " stays one chunk (GPT-2's regex alone
    # would give "Ġ" + "Ġ2024"; transformers' GGUF conversion does that).
    assert smol.encode("x  2024") == [104, 256, 34, 32, 34, 36]  # x ĠĠ 2 0 2 4
    assert smol.encode("a\n 1") == [81, 3805, 33]  # a ĊĠ 1


def test_smollm2_known_tokenizations(smol):
    assert smol.encode(" the") == [260]
    assert smol.encode("Hello world") == [19556, 905]
    assert [smol.backend.id_to_token(i) for i in smol.encode("Hello world")] == ["Hello", "Ġworld"]
    assert smol.encode("Hi", add_bos=True)[0] == 1


def test_smollm2_round_trip_prose(smol):
    ids = smol.encode(PROSE)
    assert smol.decode(ids) == PROSE
    assert len(ids) < len(PROSE)  # BPE actually merges


# Bytes with no token in SmolLM2's vocab: six control characters, the
# never-valid UTF-8 bytes, and the lead bytes 0xF1/0xF2 of U+40000..U+BFFFF
# (unassigned planes 4-11). Like llama.cpp (and a BPE without unk_token), the
# tokenizer drops them, so text containing them cannot round-trip.
MISSING_BYTES = {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)}


def gpt2_byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what ByteLevel emits)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    symbols = {b: chr(b) for b in printable}
    symbols.update({b: chr(256 + k) for k, b in enumerate(others)})
    return symbols


def test_smollm2_bytes_missing_from_vocab_are_dropped(smol):
    symbols = gpt2_byte_symbols()
    assert set(symbols.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    missing = {b for b, sym in symbols.items() if smol.backend.token_to_id(sym) is None}
    assert missing == MISSING_BYTES
    assert smol.encode("\x04") == []
    assert smol.decode(smol.encode("a\x04b")) == "ab"
    # U+40000 is F1 80 80 80: the lead byte is lost, three 0x80 remain.
    assert smol.decode(smol.encode("x\U00040000y")) == "x\ufffd\ufffd\ufffdy"


SPECIAL_STRINGS = ("<|", "<repo", "<file", "<gh_", "<issue", "<jupyter", "<empty")
COVERED_CHARS = st.characters(
    max_codepoint=0x3FFFF, exclude_categories=["Cs"], exclude_characters="\x04\x06\x13\x14\x16\x1d"
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(COVERED_CHARS, max_size=120))
def test_smollm2_round_trip_random_text(smol, text):
    assume(not any(s in text for s in SPECIAL_STRINGS))
    assert smol.decode(smol.encode(text)) == text


def test_smollm2_batch_matches_single(smol):
    texts = [PROSE, "", "12 apples", "<|im_start|>user"]
    assert smol.encode_batch(texts, add_bos=True) == [smol.encode(t, add_bos=True) for t in texts]


def test_smollm2_chat_template_default_system(smol):
    prompt = smol.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_chat_template_with_system(smol):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert smol.apply_chat_template(messages, add_generation_prompt=False) == expected
    prompt = smol.apply_chat_template(messages)
    assert prompt == expected + "<|im_start|>assistant\n"
    ids = smol.encode_chat(messages)
    assert ids == smol.encode(prompt, allow_special=True)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_smollm2_hf_dir_gives_identical_ids(smol, tmp_path):
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|im_end|>",
        "chat_template": smol.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = load_tokenizer(tmp_path)
    assert (hf.bos_id, hf.eos_id, hf.pad_id, hf.vocab_size) == (1, 2, 2, 49152)
    texts = [PROSE, "12345", "Hello world", "<|im_start|>user\nHi<|im_end|>"]
    assert hf.encode_batch(texts) == smol.encode_batch(texts)
    messages = [{"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(messages) == smol.apply_chat_template(messages)


def test_hf_dir_without_config(smol, tmp_path):
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.bos_id, hf.eos_id, hf.chat_template) == (None, None, None)
    assert hf.encode("12 the") == smol.encode("12 the")
