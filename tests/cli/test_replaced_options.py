"""An option of an earlier version (agent_loop.cli.config_file.REPLACED) is refused in one line that names what
replaced it, as a flag and as a config-file key; a command without that replacement does not know the name."""

from __future__ import annotations

import pytest

from agent_loop.cli import main
from agent_loop.cli.config_file import REPLACED


@pytest.mark.parametrize(("argv", "line"), [
    (["--rollout-servers", "http://127.0.0.1:9"], "--rollout-servers: no longer an option; use --server, once per"),
    (["--off-policy"], "--off-policy: no longer an option; use --max-staleness 1"),
    (["--off-policy", "true"], "--off-policy: no longer an option; use --max-staleness 1"),
])
def test_an_old_train_flag_names_its_replacement(argv, line, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert line in err and len(err.strip().splitlines()) == 1


def test_an_old_config_key_names_its_replacement(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("rollout_servers: http://127.0.0.1:9\nsteps: 1\n")
    assert main(["train", "--config", str(old)]) == 2
    assert f"{old}: rollout_servers: no longer an option; use server, once per server URL" in capsys.readouterr().err


def test_a_command_without_the_replacement_does_not_know_the_old_name(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["rollout", "--off-policy"])
    assert stopped.value.code == 2 and "unrecognized arguments: --off-policy" in capsys.readouterr().err
    assert set(REPLACED) == {"rollout_servers", "off_policy"}
