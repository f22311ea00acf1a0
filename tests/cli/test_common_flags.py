"""Every command takes the same common flags (``--threads``, ``--progress/--no-progress``, ``--verbose``) and says what ``--model``
takes, the built-in names from the registry (issue 49 items 9 and 11)."""

from __future__ import annotations

import dataclasses

import pytest

from agent_loop.builtin_models import builtin_names
from agent_loop.cli import COMMANDS, build_parser, main
from agent_loop.cli.flags import CommonOptions, flag


def commands() -> dict:
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    return dict(subparsers.choices)


def common_flags() -> set[str]:
    flags = {flag(f.name) for f in dataclasses.fields(CommonOptions)}
    return flags | {f"--no-{f[2:]}" for f in flags if f in ("--progress", "--verbose")}


def test_every_command_takes_the_common_flags():
    parsers = commands()
    assert len(parsers) == len(COMMANDS) >= 9
    assert common_flags() == {"--threads", "--progress", "--no-progress", "--verbose", "--no-verbose"}
    missing = {name: sorted(common_flags() - set(parser._option_string_actions))
               for name, parser in parsers.items()}
    assert {name: lacks for name, lacks in missing.items() if lacks} == {}
    for name, parser in parsers.items():  # parsed the same way everywhere
        parsed = parser.parse_args(["--no-progress", "--threads", "2", "--verbose"]
                                   + (["x.jsonl"] if name == "inspect" else []))
        assert parsed.progress is False and parsed.verbose is True


@pytest.mark.slow
def test_rollout_no_progress_draws_no_bar(capsys, tmp_path, monkeypatch):
    """rollout had no --no-progress (issue 49 item 9): its bar, and the model loading's, are on stderr unless
    it is given."""
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)  # restored after
    logging.enable_progress_bar()  # an earlier --no-progress in this process turned them off
    enable_progress_bars()
    drawn = {}
    try:
        for progress in ("--progress", "--no-progress"):
            out = tmp_path / f"{progress}.jsonl"
            assert main(["rollout", "--episodes", "2", "--concurrency", "2", "--out", str(out), progress]) == 0
            drawn[progress] = capsys.readouterr().err
    finally:  # the bars of the tests after this one
        logging.enable_progress_bar()
        enable_progress_bars()
    assert "rollout arithmetic" in drawn["--progress"] and "Loading weights" in drawn["--progress"]
    assert "%|" not in drawn["--no-progress"] and "rollout arithmetic" not in drawn["--no-progress"]


def model_help(parser) -> str:
    action = parser._option_string_actions["--model"]
    return " ".join(action.help.split())


def test_every_model_option_lists_the_built_in_names():
    with_model = {name: parser for name, parser in commands().items() if "--model" in parser._option_string_actions}
    assert {"rollout", "train", "warmstart", "serve", "proxy"} <= set(with_model)
    assert {"smollm2-135m", "tiny", "tiny-mid"} <= set(builtin_names())
    for name, parser in with_model.items():
        text = model_help(parser)
        assert all(builtin in text for builtin in builtin_names()), (name, text)
        assert "agent-loop models" in text and "folder" in text


def test_the_model_help_reads_the_registry(monkeypatch):
    import agent_loop.builtin_models as registry

    monkeypatch.setattr(registry, "TINY_NAMES", ("tiny", "tiny-mid", "tiny-other"))
    assert "tiny-other" in registry.model_option_help()
