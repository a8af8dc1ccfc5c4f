"""Value guesses from the schema and the request: literal cases."""

from __future__ import annotations

from infer.slots.guesses import request_numbers, schema_choices, unused, value_guesses, written_numbers


def test_request_numbers_are_read_as_json_writes_them():
    text = "Lend $500,000 at 7% (or 0.5%) from 2018-2019, at -74.0060 W; H2O, v1.2.3 and 1,5 apples"
    # a version's numbers run into a letter and each other: none
    assert request_numbers(text) == ["500000", "7", "0.07", "0.5", "0.005", "2018", "2019", "-74.0060", "1", "5"]
    assert request_numbers("250% of 100%, 12.5%") == ["250", "2.5", "100", "1", "12.5", "0.125"]
    assert request_numbers("no digits here") == []


def test_numbers_the_response_wrote_are_not_guessed_again():
    written = written_numbers('{"a": 3, "b": [4, -2.5], "c": "7 items", "d": 1e3, "e": 1')
    assert written == ["3", "4", "-2.5", "1e3", "1"]  # values only: not the 7 inside a string
    assert unused(["3", "5", "3", "4", "9"], ["3"]) == ["5", "3", "4", "9"]  # a repeat stays once
    assert unused(["3", "5", "3"], ["3", "3", "5"]) == []


def test_schema_choices_are_json_literals_default_first():
    assert schema_choices({"type": "string", "enum": ["C", "F"], "default": "F"}) == ('"F"', '"C"')
    assert schema_choices({"enum": [1, 2, None]}) == ("1", "2", "null")
    assert schema_choices({"type": "boolean"}) == ("true", "false")
    assert schema_choices({"type": "boolean", "default": False}) == ("false", "true")
    assert schema_choices({"type": "string"}) == () and schema_choices("string") == ()


def test_value_guesses_by_kind_and_by_what_is_written():
    numbers = request_numbers("n is 30, k is 5, p is 0.3")
    assert value_guesses("number", (), numbers, '{"n": ', 3) == ["30", "5", "0.3"]
    assert value_guesses("number", (), numbers, '{"n": 30, "k": ', 2) == ["5", "0.3"]
    assert value_guesses("number", (), numbers, '{"n": ', 3, partial="3") == ["30"]  # goes on from the digit
    assert value_guesses("string", (), numbers, '{"n": ', 3) == []  # strings are not guessed from numbers
    assert value_guesses("string", ('"C"', '"F"'), numbers, '{"u": ', 3, partial='"') == ['"C"', '"F"']
    assert value_guesses("number", (), numbers, '{"n": ', 0) == []
