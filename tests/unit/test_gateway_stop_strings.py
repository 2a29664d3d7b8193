"""Stop strings on streamed text: across token boundaries, held back, never in the output."""
import pytest

from services.gateway.openai.stop_strings import StopStringMatcher


def run(stops, deltas, include=False):
    m = StopStringMatcher(stops, include)
    out = "".join(m.feed(d) for d in deltas)
    if m.stopped is None:
        out += m.flush()
    return out, m.stopped


def test_stop_string_split_across_tokens_is_found_and_cut():
    assert run(["END"], ["Hello E", "N", "D and more"]) == ("Hello ", "END")


def test_stop_string_is_never_emitted_even_partially_while_streaming():
    m = StopStringMatcher(["</s>"])
    emitted = [m.feed(d) for d in ["ab<", "/", "s", ">zz"]]
    assert "".join(emitted) == "ab"
    assert all("<" not in e for e in emitted)
    assert m.feed("more") == "" and m.flush() == ""


def test_holds_back_only_len_longest_minus_one_chars():
    m = StopStringMatcher(["xyz", "q"])
    assert m.feed("abcdef") == "abcd"  # "ef" could start "xyz"
    assert m.feed("g") == "e"
    assert m.flush() == "fg"
    assert m.stopped is None


def test_held_back_text_that_was_not_a_stop_is_released():
    assert run(["STOP"], ["ST", "O", "P", "!"]) == ("", "STOP")
    assert run(["STOP"], ["ST", "OR", "M"]) == ("STORM", None)


def test_earliest_completing_stop_wins_among_several():
    assert run(["world", "lo w"], ["hello world"]) == ("hel", "lo w")
    # "y" completes before "xyz" when streamed, so it must win when batched too.
    assert run(["xyz", "y"], ["axyz"]) == ("ax", "y")
    assert run(["xyz", "y"], ["a", "x", "y", "z"]) == ("ax", "y")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_result_does_not_depend_on_how_text_is_split(size):
    text = "The answer is 42.\nUser: next question"
    deltas = [text[i:i + size] for i in range(0, len(text), size)]
    assert run(["\nUser:", "Observation"], deltas) == ("The answer is 42.", "\nUser:")


def test_include_stop_str_in_output_keeps_the_stop_string():
    assert run(["END"], ["ab", "EN", "Dcd"], include=True) == ("abEND", "END")


def test_no_stop_strings_pass_text_through_unbuffered():
    m = StopStringMatcher([])
    assert not m.active
    assert m.feed("abc") == "abc" and m.flush() == ""


def test_stop_at_the_very_start_gives_empty_output():
    assert run(["Hi"], ["Hi there"]) == ("", "Hi")


def test_unicode_stop_strings():
    assert run(["。"], ["こんにち", "は。さようなら"]) == ("こんにちは", "。")
