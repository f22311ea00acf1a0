"""The ``number`` reward rule (issue 29 item 8): thousands separators and scientific notation read, integers met
exactly, other references within a stated tolerance (``NUMBER_REL_TOL`` relative, ``NUMBER_ABS_TOL`` absolute).

Checked against a plain serial reference written here (a character scanner, no regex, and the tolerance written
out), on the listed cases and on random texts built from the characters that matter.
"""

import random

import numpy as np
import pytest

from agent_loop.tasks.rewards import (
    NUMBER_ABS_TOL,
    NUMBER_REL_TOL,
    get_rule,
    number_close,
    numbers_in,
    reference_number,
)

DIGITS = "0123456789"


def _digits_at(text: str, i: int) -> int:
    """The end of the run of ASCII digits starting at ``i``."""
    while i < len(text) and text[i] in DIGITS:
        i += 1
    return i


def _numeral_at(text: str, i: int) -> int | None:
    """Where a numeral starting at ``i`` ends (sign, digits with 3-digit comma groups, fraction, exponent), or None."""
    j = i + 1 if text[i] in "-\u2212" else i
    end = _digits_at(text, j)
    if end > j:  # an integer part
        if end - j <= 3:  # comma groups: ",ddd" not followed by a digit, as many as there are
            k = end
            while text[k:k + 1] == "," and _digits_at(text, k + 1) == k + 4:
                k += 4
            end = k
        if text[end:end + 1] == "." and _digits_at(text, end + 1) > end + 1:
            end = _digits_at(text, end + 1)
    elif text[j:j + 1] == "." and _digits_at(text, j + 1) > j + 1:  # a bare fraction, ".5"
        end = _digits_at(text, j + 1)
    else:
        return None
    if text[end:end + 1] in ("e", "E"):
        k = end + 1 + (text[end + 1:end + 2] in ("+", "-"))
        if _digits_at(text, k) > k:
            end = _digits_at(text, k)
    return end


def serial_numbers(text: str) -> list[float]:
    found, i = [], 0
    while i < len(text):
        end = _numeral_at(text, i)
        if end is None:
            i += 1
            continue
        found.append(float(text[i:end].replace(",", "").replace("\u2212", "-")))
        i = end
    return found


def serial_rule(completion: str, answer) -> float:
    if isinstance(answer, str):
        numbers = serial_numbers(answer)
        assert len(numbers) == 1
        reference = numbers[0]
    else:
        reference = float(answer)
    found = serial_numbers(completion)
    if not found:
        return 0.0
    x = found[-1]
    if abs(x) == float("inf"):  # a numeral too large for a float matches nothing
        return 0.0
    if reference == int(reference):
        return 1.0 if x == reference else 0.0
    return 1.0 if abs(x - reference) <= max(NUMBER_REL_TOL * max(abs(x), abs(reference)), NUMBER_ABS_TOL) else 0.0


CASES = [  # (completion, answer, expected)
    ("The total is 198.45.", 198.447, 1.0),  # the case: rounded by the model
    ("198.447", "198.45", 1.0),  # the reference rounded instead
    ("It costs 3,500 dollars", 3500, 1.0),
    ("It costs $3,500.", "$3,500", 1.0),
    ("1e3", 1000, 1.0), ("about 3.5E+3", 3500, 1.0), ("2.5e-4", 0.00025, 1.0),
    ("3501", 3500, 0.0), ("1,000,001", 1_000_000, 0.0),  # integers: exactly, at any size
    ("3500.0", 3500, 1.0), ("-7", -7, 1.0), ("\u22127", -7, 1.0), ("7", -7, 0.0),
    ("0.3333", 1 / 3, 1.0), ("0.33", 1 / 3, 0.0), ("3.14", 3.14159, 1.0), ("3.1", 3.14159, 0.0),
    ("0", 0.3, 0.0), ("0.30000000004", 0.3, 1.0),
    ("so 12, then 449.", 449, 1.0), ("449 or 450", 449, 0.0), ("no number", "3", 0.0),
    ("1,2345", 2345, 1.0),  # not a thousands group: two numbers, the last is read
    ("12,34", 34, 1.0), ("1,234,56", 56, 1.0), ("(1,234)", 1234, 1.0),
    ("answer: .5", 0.5, 1.0), ("3 eggs", 3, 1.0), ("5.", 5, 1.0),
    ("1e400", 5, 0.0),  # inf is no number's match
]


@pytest.mark.parametrize("completion,answer,expected", CASES)
def test_the_number_rule_on_its_cases_and_against_the_serial_reference(completion, answer, expected):
    rule = get_rule("number")
    assert rule(completion=completion, answer=answer) == expected
    assert serial_rule(completion, answer) == expected
    assert numbers_in(completion) == serial_numbers(completion)


def test_the_reader_equals_the_serial_scanner_on_random_texts():
    rng = random.Random(0)
    pieces = list("0123456789") * 3 + [",", ".", "e", "E", "-", "+", "\u2212", " ", "x", ",", "."]
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert numbers_in(text) == serial_numbers(text), text
        for answer in (1000, 0.25, -3.5, 12):
            assert number_close(text, answer) == serial_rule(text, answer), (text, answer)


def test_the_tolerance_is_stated_and_can_be_set():
    assert (NUMBER_REL_TOL, NUMBER_ABS_TOL) == (1e-3, 1e-9)
    assert number_close("198.45", 198.447, rel_tol=0.0, abs_tol=0.0) == 0.0  # exact when asked
    assert number_close("2.0", 2.1, rel_tol=0.05) == 1.0
    assert number_close("1e-10", 1e-12) == 1.0  # within the absolute tolerance near 0


@pytest.mark.parametrize("answer,message", [
    ("three", "reference answer 'three' is not one number"), ("1 or 2", "is not one number"),
    (None, "reference answer None is not a number"), (float("nan"), "is not a finite number"),
])
def test_a_reference_that_is_not_a_number_is_an_error(answer, message):
    with pytest.raises(ValueError, match=message):
        reference_number(answer)


def test_numpy_references_are_numbers():
    assert number_close("3,500", np.int64(3500)) == 1.0 and number_close("0.25", np.float32(0.25)) == 1.0
