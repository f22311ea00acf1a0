"""The float options of parsers not built from a dataclass (proxy, inspect) use the one validator,
``agent_loop.cli.flags.number_in``: a usage error (exit 2) in a declared field's words."""

import argparse

import pytest

from agent_loop.cli import main
from agent_loop.cli.flags import number_in


@pytest.mark.parametrize("argv, message", [
    (["inspect", "x.jsonl", "--gamma", "1.5"], "argument --gamma: 1.5: must be a number >= 0 and <= 1"),
    (["inspect", "x.jsonl", "--gamma", "nan"], "argument --gamma: nan: must be a number >= 0 and <= 1"),
    (["proxy", "--idle-timeout-s", "0"], "argument --idle-timeout-s: 0: must be a number > 0"),
    (["proxy", "--idle-timeout-s", "soon"], "argument --idle-timeout-s: soon: must be a number > 0"),
])
def test_a_number_out_of_bounds_is_a_usage_error_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(message)


def test_bounds_are_kept_exactly():
    unit = number_in(ge=0, le=1)
    assert [unit(t) for t in ("0", "1", " 0.25")] == [0.0, 1.0, 0.25]
    positive = number_in(gt=0)
    assert positive("1e-9") == 1e-9
    for convert, text in ((unit, "-0.001"), (unit, "1.0001"), (positive, "0"), (positive, "-inf")):
        with pytest.raises(argparse.ArgumentTypeError):
            convert(text)
    below = number_in(lt=2)
    assert below("1.5") == 1.5
    with pytest.raises(argparse.ArgumentTypeError, match="must be a number < 2"):
        below("2")
