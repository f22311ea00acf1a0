"""Options are declared once: no field name is declared by two option classes, old names and old configs
still load, and backend settings come from declared fields only (issue 37 item 5)."""

import dataclasses
import typing

import pytest

from agent_loop.backends.base import BackendSettings
from agent_loop.backends.server_options import ServerOptions
from agent_loop.cli.flags import UsageError, add_options, validate
from agent_loop.cli.rollout import RolloutOptions
from agent_loop.options import is_composed, options_view
from agent_loop.recipes.train_options import TrainConfig
from agent_loop.recipes.warmstart_options import WarmstartConfig
from agent_loop.runners.backend_choice import BackendOptions
from agent_loop.runners.spec import EpisodesOptions, EstimatorOptions, ResumeOptions
from agent_loop.threads import ThreadOptions
from agent_loop.training.run_options import DeviceOptions, OptimizerOptions, OutputOptions, StepsOptions

TRAIN_GROUPS = tuple(typing.get_type_hints(TrainConfig)[f.name] for f in dataclasses.fields(TrainConfig))
COMMAND_OPTIONS = (RolloutOptions, *TRAIN_GROUPS, WarmstartConfig, ThreadOptions)  # every add_options class's options


def declared_here(cls) -> set[str]:
    """The fields ``cls`` declares itself: its own annotations, less old names (InitVars) and inherited
    fields it only gives another default (``override_defaults``)."""
    own = cls.__dict__.get("__annotations__", {})
    fields = {f.name for f in dataclasses.fields(cls)}
    return {name for name in own if name in fields} - set(getattr(cls, "__overridden_defaults__", {}))


def declarations(roots) -> dict[str, list[str]]:
    """field name -> the option classes (dataclasses among ``roots`` and their bases) that declare it."""
    where: dict[str, list[str]] = {}
    classes = {base for root in roots for base in root.__mro__ if dataclasses.is_dataclass(base)}
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        for name in declared_here(cls):
            where.setdefault(name, []).append(cls.__qualname__)
    return where


def twice(roots) -> dict[str, list[str]]:
    return {name: owners for name, owners in declarations(roots).items() if len(owners) > 1}


def test_no_option_field_is_declared_in_two_classes():
    assert twice(COMMAND_OPTIONS) == {}  # no exceptions (issue 49; every option class: tests/test_layering.py)
    # TrainConfig holds its sub-configs as fields and inherits no option class (issue 55 item 2)
    assert is_composed(TrainConfig) and TrainConfig.__bases__ == (object,)
    assert [f.name for f in dataclasses.fields(TrainConfig)] == ["run", "rollout", "sampler", "update", "advantage",
                                                                   "output"]
    # the shared groups are reused, not copied: each command (train: one of its sub-configs) has their fields
    trainers = (TrainConfig, WarmstartConfig)
    for shared, commands in ((ServerOptions, (RolloutOptions, TrainConfig)), (ThreadOptions, COMMAND_OPTIONS[:1]),
                             (OptimizerOptions, trainers), (OutputOptions, trainers), (DeviceOptions, trainers),
                             (ResumeOptions, (RolloutOptions, TrainConfig, WarmstartConfig)),
                             (EstimatorOptions, (RolloutOptions, TrainConfig)),
                             (EpisodesOptions, (RolloutOptions, WarmstartConfig)), (StepsOptions, trainers),
                             (BackendOptions, (RolloutOptions, TrainConfig))):
        for command in commands:
            parts = TRAIN_GROUPS if command is TrainConfig else (command,)
            assert any(issubclass(part, shared) for part in parts), (command, shared)


def test_the_check_finds_a_field_declared_twice():
    @dataclasses.dataclass
    class A:
        lr: float = 1.0

    @dataclasses.dataclass
    class B:
        lr: float = 2.0

    @dataclasses.dataclass
    class C(A, B):
        steps: int = 1

    assert twice([C]) == {"lr": sorted(["test_the_check_finds_a_field_declared_twice.<locals>.A",
                                        "test_the_check_finds_a_field_declared_twice.<locals>.B"])}


def test_train_and_rollout_name_the_servers_alike():
    flags = {name: [f.name for f in dataclasses.fields(options_view(cls))]
             for name, cls in (("rollout", RolloutOptions), ("train", TrainConfig))}
    for field in ("server", "served_model_name", "retry_deadline_s", "request_timeout_s"):
        assert all(field in names for names in flags.values()), field
    hints = typing.get_type_hints(options_view(TrainConfig))
    assert typing.get_origin(hints["server"]) is list
    assert validate(TrainConfig, {"server": ["http://127.0.0.1:9"], "retry_deadline_s": 5,
                                  "output_dir": "unused"}).sampler.retry_deadline_s == 5.0  # train can set it now
    with pytest.raises(UsageError, match="--server nope: not an http"):
        validate(TrainConfig, {"server": ["nope"], "output_dir": "unused"})
    assert TrainConfig().sampler.served_model_name is RolloutOptions().served_model_name is None  # one default


def test_backend_settings_take_only_the_server_options():
    config = TrainConfig.from_flat(device="cuda:0", server=["http://127.0.0.1:9"], served_model_name="p",
                                   retry_deadline_s=7.0).sampler
    settings = BackendSettings.from_options(config)
    assert settings.device == BackendSettings().device == "cpu"  # train's --device never reaches the http backend
    assert (settings.servers, settings.served_model_name, settings.retry_deadline_s) == (["http://127.0.0.1:9"], "p", 7.0)
    assert BackendSettings.from_options(config, device="cuda:0").device == "cuda:0"  # asked for: given


def saved_train_config() -> dict:
    """A saved train config.yaml: flat keys, as resolved() writes them (served_model_name 'policy', threads 2)."""
    saved = TrainConfig.from_flat(output_dir="runs/old", server=["http://127.0.0.1:8000", "http://127.0.0.1:8001"],
                                  served_model_name="policy", threads=2).resolved()
    return {**saved, "lr": None}  # an unset one, as configs saved before the rate was resolved


def test_a_saved_train_config_loads_with_config_and_resumes_unchanged(tmp_path):
    import yaml

    from agent_loop.cli import build_parser
    from agent_loop.cli.flags import resolve
    from agent_loop.training import checkpoint

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved_train_config(), sort_keys=False))
    config = resolve(TrainConfig, build_parser().parse_args(["train", "--config", str(path)]))
    assert config.sampler.server == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"] and config.run.threads == 2
    saved = TrainConfig.resolve_saved(saved_train_config())  # the unset lr: the rate its own settings scale to
    assert saved["lr"] == config.learning_rate == 2e-4 * min(1.0, 64 / 2 / 32)
    assert checkpoint.changed_settings(saved, config.resolved()) == []  # no change
    # a run of today resumes from the checkpoint's config with other servers and the default name
    today = validate(TrainConfig, {"output_dir": "runs/old", "threads": 2})
    assert checkpoint.changed_settings(saved, today.resolved()) == []
    assert checkpoint.changed_settings(saved, today.replace(temperature=0.5).resolved()) == [
        "temperature: 1.0 -> 0.5"]
    assert checkpoint.changed_settings(saved, today.replace(lr=1e-3).resolved()) == ["lr: 0.0002 -> 0.001"]


def test_an_old_warmstart_and_rollout_config_load(tmp_path):
    import argparse

    from agent_loop.cli.flags import resolve

    for cls, old in ((WarmstartConfig, {"model": None, "seed": 0, "episodes": 8, "steps": 4, "batch_size": 4,
                                        "micro_batch_size": 2, "lr": None, "warmup_steps": 10, "weight_decay": 0.0,
                                        "max_grad_norm": 1.0, "output_dir": str(tmp_path / "w"), "overwrite": False,
                                        "device": "auto", "threads": 2, "progress": True, "task": "arithmetic"}),
                     (RolloutOptions, {"backend": "http", "server": ["http://127.0.0.1:8000"], "retry_deadline_s": 9,
                                       "request_timeout_s": 3, "served_model_name": None, "episodes": 2,
                                       "out": str(tmp_path / "r.jsonl")})):
        import yaml

        path = tmp_path / f"{cls.__name__}.yaml"
        path.write_text(yaml.safe_dump(old))
        parser = add_options(argparse.ArgumentParser(), cls)
        options = resolve(cls, parser.parse_args(["--config", str(path)]))
        assert {k: getattr(options, k) for k in old} == {**old, **({"retry_deadline_s": 9.0, "request_timeout_s": 3.0}
                                                                  if cls is RolloutOptions else {})}


def test_train_help_says_why_its_episode_defaults_differ_from_rollouts(capsys):
    from agent_loop.cli import main

    assert RolloutOptions().max_turns == 4 and TrainConfig().rollout.max_turns == 3
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    turns = text[text.index("--max-turns MAX_TURNS assistant"):]
    assert turns.index("default: 3 (declared default: 4); train's own, not rollout's") < 300
    assert "tiny agent's RL results" in turns[:500]


def test_the_proxy_takes_the_upstream_servers_options_as_declared():
    """agent-loop proxy --backend http: --server, --served-model-name and the retry settings are ServerOptions'
    own flags, and all of them reach the backend's settings (a hand-built settings object dropped the retries)."""
    from agent_loop.cli import build_parser
    from agent_loop.cli.proxy import server_options

    args = build_parser().parse_args(["proxy", "--backend", "http", "--server", "http://127.0.0.1:9",
                                      "--server", "http://127.0.0.1:10", "--served-model-name", "policy",
                                      "--retry-deadline-s", "5", "--request-timeout-s", "2"])
    settings = BackendSettings.from_options(server_options(args))
    assert (settings.servers, settings.served_model_name) == (["http://127.0.0.1:9", "http://127.0.0.1:10"], "policy")
    assert (settings.retry_deadline_s, settings.request_timeout_s) == (5.0, 2.0)
    with pytest.raises(UsageError, match=r"--retry-deadline-s 0: must be a number > 0"):
        server_options(build_parser().parse_args(["proxy", "--retry-deadline-s", "0"]))


def test_resume_is_one_option_alone_or_with_a_folder(tmp_path):
    """One --resume for rollout, train and warmstart (issue 49): alone, the run's own output; train and warmstart
    also take a checkpoint or run folder; a saved config's ``resume: false`` is unset."""
    from agent_loop.cli import build_parser
    from agent_loop.cli.flags import resolve

    parsed = build_parser().parse_args(["rollout", "--resume", "--episodes", "2"])
    assert (parsed.resume, parsed.episodes) == (True, "2")  # alone: the next option is not its value
    assert resolve(RolloutOptions, parsed).resume is True
    with pytest.raises(UsageError, match="--resume runs/x: takes no folder in rollout"):
        validate(RolloutOptions, {"resume": "runs/x"})
    assert validate(RolloutOptions, {"resume": False, "out": str(tmp_path / "a.jsonl")}).resume is None
    run = tmp_path / "train"
    assert validate(TrainConfig, {"resume": True, "output_dir": str(run)}).output.resume == str(run)  # --resume alone
    alone = validate(TrainConfig, {"resume": True}).output
    assert alone.resume == alone.output_dir == alone.DEFAULT_OUTPUT_DIR
    step = run / "checkpoints" / "step_000004"
    assert validate(TrainConfig, {"resume": str(step)}).output.output_dir == str(run)
    warm = validate(WarmstartConfig, {"resume": str(step)})  # warmstart takes a folder too: it goes on there
    assert (warm.resume, warm.output_dir) == (True, str(run))
    with pytest.raises(UsageError, match="--resume .*: is a checkpoint of the run in .*, not of --output-dir"):
        validate(WarmstartConfig, {"resume": str(step), "output_dir": str(tmp_path / "other")})


def test_the_go_on_hint_drops_resume_with_or_without_its_folder():
    from agent_loop.cli.stops import go_on_command

    drop = {"--output-dir": True, "--resume": "?"}
    assert go_on_command("p", ["--resume", "runs/a", "--steps", "3"], drop=drop, add=["--resume"]) == "p --steps 3 --resume"
    assert go_on_command("p", ["--resume", "--steps", "3"], drop=drop, add=[]) == "p --steps 3"


def test_rollout_takes_the_shared_estimator_and_refuses_one_a_file_cannot_show():
    with pytest.raises(UsageError, match="--estimator gae: needs critic values"):
        validate(RolloutOptions, {"estimator": "gae"})
    with pytest.raises(UsageError, match="--steps: must be set in train"):
        validate(TrainConfig, {"steps": None, "output_dir": "unused"})


def test_one_backend_option_for_rollout_and_train():
    """--backend was declared by rollout and train apart (train without http); one declaration, one rule."""
    for cls in (RolloutOptions, TrainConfig):
        with pytest.raises(UsageError, match="--backend http: needs at least one --server URL"):
            validate(cls, {"backend": "http", "output_dir": "unused"} if cls is TrainConfig else {"backend": "http"})
    served = validate(TrainConfig, {"backend": "http", "server": ["http://127.0.0.1:9"], "output_dir": "unused"})
    assert served.sampler.backend == "http"
