"""BLINK token layouts on the MiniLM (BERT uncased) vocabulary.

Expected ids are written out from vocab.txt (id = line number - 1): [PAD]=0 [unused0]=1
[unused1]=2 [unused2]=3 [CLS]=101 [SEP]=102 a..l=1037..1048 x=1060 bert=14324 and=1998
ernie=14637 are=2024 two=2048 mu=14163 ##ppet=29519 ##s=2015 warner=6654 was=2001
communications=4806 technician=16661 ##ville=3077 winnie=27125 tyler=7482.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

import dist_nce.core.text as text
from dist_nce.core.records import EntityRecord, MentionRecord
from dist_nce.core.text import (
    assemble_mention_ids,
    encode_entities,
    encode_entity,
    encode_mention,
    encode_mentions,
    load_tokenizer,
    special_ids,
    tokenizer_fingerprint,
)

CLS, SEP, PAD, M0, M1, T2 = 101, 102, 0, 1, 2, 3
a, b, c, d, e, f, g, h, i, j, k, l, x = 1037, 1038, 1039, 1040, 1041, 1042, 1043, 1044, 1045, 1046, 1047, 1048, 1060
WARNER, WAS, A, COMMS, TECH = 6654, 2001, 1037, 4806, 16661


@pytest.fixture(scope="module")
def tok(minilm_dir):
    return load_tokenizer(minilm_dir)


# ---------------------------------------------------------------- tokenizer


def test_markers_are_existing_single_tokens(tok):
    assert len(tok) == 30522  # registered, not appended
    assert tok.convert_tokens_to_ids(["[unused0]", "[unused1]", "[unused2]"]) == [1, 2, 3]
    assert tok.tokenize("bert [unused0] and [unused2]") == ["bert", "[unused0]", "and", "[unused2]"]
    assert tuple(special_ids(tok)) == (CLS, SEP, PAD, M0, M1, T2)


def test_vocab_without_markers_is_refused(tmp_path):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\nb\n")
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer", "do_lower_case": true}')
    with pytest.raises(ValueError, match=r"vocabulary lacks \['\[unused0\]', '\[unused1\]', '\[unused2\]'\]"):
        load_tokenizer(str(tmp_path))


def test_fingerprint_identifies_the_vocabulary(tok, minilm_dir):
    fp = tokenizer_fingerprint(tok)
    assert fp["vocab_size"] == 30522 and len(fp["sha256"]) == 64
    assert tokenizer_fingerprint(load_tokenizer(minilm_dir)) == fp
    other = load_tokenizer(minilm_dir)
    other.add_tokens(["zzzz-new-piece"])
    assert tokenizer_fingerprint(other)["sha256"] != fp["sha256"]


# ---------------------------------------------------------------- mentions, exact ids


def test_mention_layout_exact_ids(tok):
    assert encode_mention(tok, "Bert and", "Ernie", "are two Muppets", 32) == [
        CLS, 14324, 1998, M0, 14637, M1, 2024, 2048, 14163, 29519, 2015, SEP]


def test_mention_centred_and_contexts_cut_from_far_ends(tok):
    left, right = "a b c d e f", "g h i j k l"
    # room = 9 - 4 - 1 = 4: two tokens each side, left keeps its end, right its start
    assert encode_mention(tok, left, "x", right, 9) == [CLS, e, f, M0, x, M1, g, h, SEP]
    # odd room 5: the left gets the floor half (as in BLINK)
    assert encode_mention(tok, left, "x", right, 10) == [CLS, e, f, M0, x, M1, g, h, i, SEP]


def test_unused_quota_goes_to_the_other_side(tok):
    assert encode_mention(tok, "a", "x", "g h i j k l", 9) == [CLS, a, M0, x, M1, g, h, i, SEP]
    assert encode_mention(tok, "a b c d e f", "x", "g", 9) == [CLS, d, e, f, M0, x, M1, g, SEP]


def test_mention_at_start_or_end_of_document(tok):
    assert encode_mention(tok, "", "x", "g h i j k l", 9) == [CLS, M0, x, M1, g, h, i, j, SEP]
    assert encode_mention(tok, "a b c d e f", "x", "", 9) == [CLS, c, d, e, f, M0, x, M1, SEP]


def test_empty_contexts(tok):
    assert encode_mention(tok, "", "x", "", 32) == [CLS, M0, x, M1, SEP]
    assert encode_mention(tok, "   ", "x", "\n", 32) == [CLS, M0, x, M1, SEP]


def test_overlong_mention_is_truncated_and_keeps_its_markers(tok):
    assert encode_mention(tok, "a", "b c d e f", "g", 7) == [CLS, M0, b, c, d, M1, SEP]


def test_literal_special_token_text_is_text(tok):
    ids = encode_mention(tok, "a [SEP]", "[unused1]", "b", 32)
    assert ids.count(SEP) == 1 and ids.count(M1) == 1 and ids[-1] == SEP


def test_too_small_max_len(tok):
    with pytest.raises(ValueError, match="mention max_len must be >= 5"):
        encode_mention(tok, "a", "b", "c", 4)
    with pytest.raises(ValueError, match="entity max_len must be >= 4"):
        encode_entity(tok, "a", "b", 3)


def blink_reference(left: list, mention: list, right: list, max_len: int) -> list:
    """BLINK's get_context_representation quota rule, written its way (with the mention
    truncated first, and its ``context_left[-0:]`` corner case taken as empty)."""
    mention_tokens = [M0] + mention[:max_len - 4] + [M1]
    left_quota = (max_len - len(mention_tokens)) // 2 - 1
    right_quota = max_len - len(mention_tokens) - left_quota - 2
    if len(left) <= left_quota:
        if len(right) > right_quota:
            right_quota += left_quota - len(left)
    elif len(right) <= right_quota:
        left_quota += right_quota - len(right)
    kept_left = left[-left_quota:] if left_quota > 0 else []
    return [CLS] + kept_left + mention_tokens + right[:right_quota] + [SEP]


def test_quota_rule_equals_blinks_on_every_small_case():
    sp = text.SpecialIds(CLS, SEP, PAD, M0, M1, T2)
    for max_len in range(5, 13):
        for n_left in range(0, 12):
            for n_mention in range(0, 10):
                for n_right in range(0, 12):
                    left, mention = list(range(1000, 1000 + n_left)), list(range(2000, 2000 + n_mention))
                    right = list(range(3000, 3000 + n_right))
                    got = assemble_mention_ids(left, mention, right, max_len, sp)
                    assert got == blink_reference(left, mention, right, max_len), (max_len, n_left, n_mention, n_right)
                    assert len(got) == min(max_len, n_left + min(n_mention, max_len - 4) + n_right + 4)


# ---------------------------------------------------------------- entities, exact ids


DESC = "Warner Warner was a communications technician"


def test_entity_layout_keeps_the_title_twice_by_default(tok):
    assert encode_entity(tok, "Warner", DESC, 128) == [CLS, WARNER, T2, WARNER, WARNER, WAS, A, COMMS, TECH, SEP]


def test_strip_title(tok):
    assert encode_entity(tok, "Warner", DESC, 128, strip_title=True) == [CLS, WARNER, T2, WARNER, WAS, A, COMMS, TECH, SEP]
    # a description not starting with the title is left alone
    assert encode_entity(tok, "Warner", "was a", 128, strip_title=True) == [CLS, WARNER, T2, WAS, A, SEP]
    # whole words only: "Warnerville" begins with the piece "warner" but is another word
    assert encode_entity(tok, "Warner", "Warnerville was", 128, strip_title=True) == [
        CLS, WARNER, T2, WARNER, 3077, WAS, SEP]
    # compared as (lower-cased) tokens: case does not matter
    assert encode_entity(tok, "Winnie Tyler", "WINNIE TYLER Winnie Tyler was", 128, strip_title=True) == [
        CLS, 27125, 7482, T2, 27125, 7482, WAS, SEP]
    # Zeshel's spaced punctuation matches the title's unspaced one
    assert (encode_entity(tok, "C. W. Jessen", "C . W . Jessen was an admiral", 128, strip_title=True)
            == encode_entity(tok, "C. W. Jessen", "was an admiral", 128))


def test_entity_truncation(tok):
    # description cut from its far end
    assert encode_entity(tok, "Warner", DESC, 6) == [CLS, WARNER, T2, WARNER, WARNER, SEP]
    assert encode_entity(tok, "Warner", DESC, 6, strip_title=True) == [CLS, WARNER, T2, WARNER, WAS, SEP]
    # an over-long title keeps max_len - 3 tokens and the separator
    assert encode_entity(tok, "a b c d e f", "g", 6) == [CLS, a, b, c, T2, SEP]
    assert encode_entity(tok, "", "", 6) == [CLS, T2, SEP]


# ---------------------------------------------------------------- batch == per record


WORDS = ["the", "Bert", "Ernie", "Muppets", "Sesame", "Street", "end.", "(x)", "it's", "U.S.", "1996-08-30",
         "Zürich", "Šuker", "Kraków", "ΟΔΟΣ", "東京都", "e\u0301te\u0301", "naïve", "🙂", "[SEP]", "[unused0]",
         "x" * 120, "supercalifragilisticexpialidocious", "a\tb", "c\nd", "\x00", "—", "«quoted»"]


def random_text(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words)))


def random_mentions(seed: int, n: int) -> list[MentionRecord]:
    rng = random.Random(seed)
    return [MentionRecord(str(m), random_text(rng, rng.choice([3, 60, 400])), random_text(rng, rng.choice([1, 4, 80])),
                          random_text(rng, rng.choice([3, 60, 400]))) for m in range(n)]


def random_entities(seed: int, n: int) -> list[EntityRecord]:
    rng = random.Random(seed)
    out = []
    for m in range(n):
        title = random_text(rng, rng.choice([1, 3, 150]))
        body = random_text(rng, rng.choice([0, 20, 600]))
        # Zeshel-style: most descriptions begin with the title (case and spacing may differ)
        desc = rng.choice([f"{title} {body}", f"{title.upper()} {body}", body, title + body])
        out.append(EntityRecord(str(m), title, desc))
    return out


def assert_rows_equal(batch: np.ndarray, rows: list[list[int]], max_len: int):
    assert batch.dtype == np.int32 and batch.shape == (len(rows), max_len)
    for got, want in zip(batch, rows):
        assert len(want) <= max_len
        assert got.tolist() == want + [PAD] * (max_len - len(want))


@pytest.mark.parametrize("chars_per_token", [text._CHARS_PER_TOKEN, 1])  # 1: windows too short, redone whole
@pytest.mark.parametrize("max_len", [32, 128])
def test_encode_mentions_equals_per_record(tok, monkeypatch, chars_per_token, max_len):
    monkeypatch.setattr(text, "_CHARS_PER_TOKEN", chars_per_token)
    recs = random_mentions(seed=max_len, n=60)
    rows = [encode_mention(tok, r.left, r.mention, r.right, max_len) for r in recs]
    assert_rows_equal(encode_mentions(tok, recs, max_len), rows, max_len)


@pytest.mark.parametrize("chars_per_token", [text._CHARS_PER_TOKEN, 1])
@pytest.mark.parametrize("strip_title", [False, True])
@pytest.mark.parametrize("max_len", [32, 128])
def test_encode_entities_equals_per_record(tok, monkeypatch, chars_per_token, strip_title, max_len):
    monkeypatch.setattr(text, "_CHARS_PER_TOKEN", chars_per_token)
    recs = random_entities(seed=max_len + strip_title, n=60)
    rows = [encode_entity(tok, r.title, r.description, max_len, strip_title) for r in recs]
    assert_rows_equal(encode_entities(tok, recs, max_len, strip_title), rows, max_len)


def test_windows_are_exact_prefixes_and_suffixes(tok):
    """The property the batch path rests on: cutting at a space splits the token list."""
    rng = random.Random(7)
    for _ in range(100):
        t = random_text(rng, 300)
        full = tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        for tail in (False, True):
            piece, whole = text._window(t, rng.randint(1, 400), tail)
            ids = tok(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if whole:
                assert ids == full
            elif tail:
                assert ids == full[len(full) - len(ids):]
            else:
                assert ids == full[:len(ids)]


def test_batch_chunks_and_empty_input(tok, monkeypatch):
    monkeypatch.setattr(text, "_CHUNK", 7)
    recs = random_entities(seed=3, n=20)
    rows = [encode_entity(tok, r.title, r.description, 32) for r in recs]
    assert_rows_equal(encode_entities(tok, recs, 32), rows, 32)
    assert encode_entities(tok, [], 32).shape == (0, 32)
    assert encode_mentions(tok, [], 32).shape == (0, 32)
