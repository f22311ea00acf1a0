"""Every ``agent-loop`` command line in README.md and in the pages it sends readers to (docs/quickstart.md,
docs/bring_your_own.md, docs/training.md) parses as written: its command exists, its flags are
the command's own, and its values pass the same checks as a real run (``resolve``: types, bounds, the
rules across options). Running them is the job of the tests of each command; this keeps the README's
spelling in step with the CLI (a renamed or dropped flag fails here)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from agent_loop import TrainConfig
from agent_loop.cli import build_parser
from agent_loop.cli.flags import resolve
from agent_loop.cli.inspect import check_arguments
from agent_loop.cli.rollout import RolloutOptions
from agent_loop.recipes.warmstart_options import WarmstartConfig

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README] + [REPO / "docs" / name for name in ("quickstart.md", "bring_your_own.md", "training.md")]
OPTIONS = {"rollout": RolloutOptions, "train": TrainConfig, "warmstart": WarmstartConfig}


def readme_commands(page: Path = README) -> list[str]:
    """The ``agent-loop ...`` commands of a page's bash blocks (continued lines joined), without comments,
    ``&`` or ``...``."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    commands = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        for part in re.split(r"&&", line.split("  #")[0]):
            words = shlex.split(part.strip().rstrip("&"), comments=True)
            if words and Path(words[0]).name == "agent-loop":
                commands.append(shlex.join(word for word in words[1:] if word != "..."))
    return commands


def test_the_readme_has_the_commands_it_documents():
    commands = readme_commands()
    assert {c.split()[0] for c in commands} == {"rollout", "train", "warmstart", "inspect", "serve", "tiny", "models", "proxy"}
    assert "rollout" in commands  # the first command: no flags


def test_each_page_readme_sends_readers_to_opens_with_a_runnable_command():
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in README.read_text(), page.name  # README links it
        first_block = re.search(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
        assert first_block and page.read_text().index(first_block.group(0)) < 200, page.name  # right under its title
        assert readme_commands(page), page.name


@pytest.mark.parametrize("command", sorted({c for page in PAGES for c in readme_commands(page)}))
def test_a_readme_command_parses_and_its_options_validate(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # inspect checks its output folders; runs/ is where README writes
    (tmp_path / "runs").mkdir()
    args = build_parser().parse_args(shlex.split(command))  # SystemExit(2) on an unknown flag
    name = command.split()[0]
    if name in OPTIONS and getattr(args, "config", None) is None:
        resolve(OPTIONS[name], args)
    elif name == "inspect":
        check_arguments(args)
