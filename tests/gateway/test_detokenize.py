from __future__ import annotations

import itertools

import pytest

from services.gateway.detokenize import REPLACEMENT, IncrementalDetokenizer, StopChecker

MULTIBYTE = "Hello 😀 world 你好世界, café — 👨‍👩‍👧 🇯🇵 こんにちは مرحبا ok"


class SpyTokenizer:
    """Wraps the real tokenizer and records how many ids each decode call saw."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    pieces = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*pieces, detok.flush()]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_multibyte_case_really_splits_characters(smol_tokenizer):
    ids = encode(smol_tokenizer, MULTIBYTE)
    assert any(REPLACEMENT in smol_tokenizer.decode([i]) for i in ids)  # else this file tests nothing


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_stream_equals_full_decode_and_never_shows_a_broken_character(smol_tokenizer, chunk):
    ids = encode(smol_tokenizer, MULTIBYTE)
    pieces = stream(IncrementalDetokenizer(smol_tokenizer), ids, chunk)
    assert "".join(pieces) == smol_tokenizer.decode(ids) == MULTIBYTE
    assert not any(REPLACEMENT in p for p in pieces)


def test_text_is_released_as_soon_as_the_character_completes(smol_tokenizer):
    ids = encode(smol_tokenizer, "a😀")
    detok = IncrementalDetokenizer(smol_tokenizer)
    outs = [detok.add([i]) for i in ids]
    assert outs[-1].endswith("😀")  # released on the token that completes it, not at flush
    assert "".join(outs) == "a😀"
    assert detok.flush() == ""


def test_an_incomplete_tail_is_held_then_flushed(smol_tokenizer):
    ids = encode(smol_tokenizer, "ok 😀")
    partial = ids[:-1]  # the emoji's last piece is missing
    assert smol_tokenizer.decode(partial).endswith(REPLACEMENT)
    detok = IncrementalDetokenizer(smol_tokenizer)
    text = detok.add(partial)
    assert REPLACEMENT not in text
    assert text + detok.flush() == smol_tokenizer.decode(partial)


def test_each_step_decodes_a_short_window(smol_tokenizer):
    spy = SpyTokenizer(smol_tokenizer)
    ids = encode(smol_tokenizer, (MULTIBYTE + " The quick brown fox jumps over the lazy dog. ") * 20)
    assert len(ids) > 400
    pieces = stream(IncrementalDetokenizer(spy), ids)
    assert "".join(pieces) == smol_tokenizer.decode(ids)
    assert max(spy.window_sizes) <= 8  # not the whole sequence: the cost per token stays flat


def test_special_tokens_are_skipped_by_default(smol_tokenizer):
    ids = [*encode(smol_tokenizer, "done"), smol_tokenizer.eos_token_id]
    assert "".join(stream(IncrementalDetokenizer(smol_tokenizer), ids)) == "done"
    kept = "".join(stream(IncrementalDetokenizer(smol_tokenizer, skip_special_tokens=False), ids))
    assert kept == "done" + smol_tokenizer.eos_token


def test_a_literal_replacement_character_does_not_stall_the_stream(smol_tokenizer):
    ids = encode(smol_tokenizer, "x" + REPLACEMENT * 8)
    detok = IncrementalDetokenizer(smol_tokenizer)
    before_flush = detok.add(ids)
    assert REPLACEMENT in before_flush  # released before the end of the stream
    assert before_flush + detok.flush() == smol_tokenizer.decode(ids)


# --- stop strings ----------------------------------------------------------------------------


def run(checker: StopChecker, pieces: list[str]) -> tuple[list[str], bool]:
    outs, stopped = [], False
    for p in pieces:
        text, stopped = checker.add(p)
        outs.append(text)
        if stopped:
            break
    if not stopped:
        outs.append(checker.flush())
    return outs, stopped


def test_no_stops_passes_text_straight_through():
    checker = StopChecker([])
    assert checker.add("abc") == ("abc", False)
    assert checker.add("def") == ("def", False)
    assert checker.flush() == ""


def test_stop_split_across_pieces():
    outs, stopped = run(StopChecker(["END"]), ["abc E", "N", "D more"])
    assert outs == ["abc ", "", ""] and stopped


def test_a_false_start_is_released():
    checker = StopChecker(["END"])
    assert checker.add("x E") == ("x ", False)
    assert checker.add("NX") == ("ENX", False)
    assert checker.add("EN") == ("", False)
    assert checker.flush() == "EN"  # the stream ended: it was not a stop after all


def test_stop_at_the_very_start():
    checker = StopChecker(["END"])
    assert checker.add("END and more") == ("", True)
    assert checker.stopped
    assert checker.add("later") == ("", True)
    assert checker.flush() == ""


def test_the_earliest_of_several_stops_wins():
    assert StopChecker(["world", "lo"]).add("hello world") == ("hel", True)
    assert StopChecker(["\n\n", "###"]).add("a ### b\n\n") == ("a ", True)


def test_overlapping_partial_matches():
    checker = StopChecker(["aab"])
    assert checker.add("aa") == ("", False)
    assert checker.add("aab") == ("aa", True)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopChecker(["ok", ""])


@pytest.mark.parametrize(
    "stops",
    [["END"], ["END", "DE"], ["aa", "ab"], ["x"], ["<|im_end|>"], ["🙂"]],
)
def test_every_split_gives_the_text_up_to_the_first_stop(stops):
    text = "abaaDEND x <|im_end|> 🙂 tail"
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    expected = text if cut is None else text[:cut]
    for a, b in itertools.combinations(range(len(text) + 1), 2):
        outs, stopped = run(StopChecker(stops), [text[:a], text[a:b], text[b:]])
        assert "".join(outs) == expected, (a, b)
        assert stopped == (cut is not None)
        for s in stops:  # no emitted prefix ever contains the stop
            assert s not in "".join(outs)


def test_detokenizer_and_stop_checker_together(smol_tokenizer):
    ids = encode(smol_tokenizer, "hi 你好 there")
    detok, checker = IncrementalDetokenizer(smol_tokenizer), StopChecker(["好"])
    sent, stopped = "", False
    for i in ids:
        text, stopped = checker.add(detok.add([i]))
        sent += text
        if stopped:
            break
    assert stopped and sent == "hi 你"


def test_what_precedes_an_incomplete_character_is_released_at_once(smol_tokenizer):
    """A token of a space and a character's first byte (a first token the model gives on CJK or
    emoji answers) shows its space with that token, not with the one that completes the
    character: with the first token from prefill, a client sees text before the second token."""
    split = next(i for i in range(smol_tokenizer.vocab_size) if smol_tokenizer.decode([i]) == " " + REPLACEMENT)
    rest = next(i for i in range(smol_tokenizer.vocab_size) if REPLACEMENT not in smol_tokenizer.decode([split, i]))
    detok = IncrementalDetokenizer(smol_tokenizer)
    first = detok.add([split])
    assert first == " "
    second = detok.add([rest])
    assert first + second == smol_tokenizer.decode([split, rest]) and REPLACEMENT not in second
    ids = encode(smol_tokenizer, "ok 你好 😀 ok")
    pieces = stream(IncrementalDetokenizer(smol_tokenizer), ids)
    assert "".join(pieces) == "ok 你好 😀 ok" and not any(REPLACEMENT in p for p in pieces)
