"""The shipped chain-stage build (agent_loop.tiny.chain): checked by sha256, unpacked into the cache's layout and
loadable; with no shipped archive chain_agent_path still builds from the recipe."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_loop.tiny import build as tiny_build
from agent_loop.tiny import chain


def test_the_shipped_chain_build_unpacks_into_a_loadable_cache_folder(tmp_path):
    target = tmp_path / chain.chain_build_dir().name
    assert tiny_build.shipped_archive(target.name) is not None, "the chain stage is shipped"
    assert tiny_build.unpack_shipped(target)
    record = json.loads((target / "build.json").read_text())
    assert record["recipe"] == f"{tiny_build.RECIPE_VERSION}-chain" and set(record["stages"]) == set(tiny_build.STAGES)
    assert record["base"] == f"{tiny_build.build_dir().name}/final", "no machine's absolute path is shipped"
    base = AutoModelForCausalLM.from_pretrained(tiny_build.tiny_agent_path("final"), dtype=torch.float32)
    for stage in tiny_build.STAGES:
        model = AutoModelForCausalLM.from_pretrained(target / stage, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(target / stage)
        assert model.num_parameters() == base.num_parameters() and len(tokenizer) == base.config.vocab_size
        assert [e["episodes"] for e in record["stages"][stage]["eval"]] == [chain.EVAL_EPISODES] * 2


def test_chain_agent_path_unpacks_instead_of_building(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LOOP_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny_build, "build", lambda *a, **k: pytest.fail("built although shipped"))
    tiny_build.unpack_shipped(tmp_path / tiny_build.build_dir().name)  # the base, as the real cache holds it
    path = chain.chain_agent_path("final")
    assert path == tmp_path / chain.chain_build_dir().name / "final" and (path / "model.safetensors").is_file()
    assert "sha256" in (path.parent / "shipped.txt").read_text()


def test_a_damaged_chain_archive_gives_the_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LOOP_CACHE", str(tmp_path))
    monkeypatch.setitem(tiny_build.SHIPPED_SHA256, chain.chain_build_dir().name, "0" * 64)
    with pytest.raises(RuntimeError, match=f"{chain.chain_build_dir().name}.tar.xz is damaged .*restore it from git"):
        chain.chain_agent_path("mid")
    assert not chain.chain_build_dir().exists()


def test_without_a_shipped_archive_the_chain_stage_is_built_from_the_recipe(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LOOP_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny_build, "SHIPPED_SHA256", {})  # the recipe's path
    base = tmp_path / "base" / "final"
    monkeypatch.setattr(chain, "tiny_agent_path", lambda stage: base)
    calls = []

    def fake_build_into(folder, given_base, progress):
        calls.append(given_base)
        for stage in tiny_build.STAGES:
            (folder / stage).mkdir()
        (folder / "build.json").write_text("{}")
        return {}

    monkeypatch.setattr(chain, "_build_into", fake_build_into)
    assert chain.chain_agent_path("mid") == tmp_path / chain.chain_build_dir().name / "mid"
    assert chain.chain_agent_path("final").is_dir() and calls == [base], "built once, from the default final stage"
    assert not (tmp_path / chain.chain_build_dir().name / "shipped.txt").exists()
