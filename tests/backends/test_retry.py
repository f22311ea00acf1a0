"""One backoff rule (agent_loop/backends/retry.py): its delays against a plain serial reference, and every retry in
the library waits by it (the agent loop's uncapped backend retries, the HTTP backend's capped request and start-up
retries); no other exponential backoff is written anywhere."""

import ast
import asyncio
from pathlib import Path

import pytest

from agent_loop.backends import openai_http, vllm_server
from agent_loop.backends.base import Backend
from agent_loop.backends.retry import backoff_delay
from agent_loop.episode import loop
from agent_loop.episode.loop_config import LoopConfig
from tests.helpers.http_stub import MODEL, StubServer, sampling

ROOT = Path(__file__).resolve().parents[2]


def reference_delays(attempts: int, base_s: float, cap_s: float | None) -> list[float]:
    """Wait base_s, then twice the last wait each time, never more than cap_s."""
    out, wait = [], base_s
    for _ in range(attempts):
        out.append(wait if cap_s is None else min(cap_s, wait))
        wait *= 2
    return out


@pytest.mark.parametrize("base_s, cap_s", [(0.5, None), (0.5, 5.0), (0.01, 0.02), (0.0, None), (1.5, 1.5)])
def test_delays_double_from_the_base_up_to_the_cap(base_s, cap_s):
    assert [backoff_delay(a, base_s=base_s, cap_s=cap_s) for a in range(12)] == reference_delays(12, base_s, cap_s)
    assert backoff_delay(3, base_s=0.5) == 4.0 and backoff_delay(30, base_s=0.5, cap_s=5.0) == 5.0


def recording(monkeypatch, module) -> list[tuple]:
    """Every backoff_delay call ``module`` makes, as (attempt, base_s, cap_s, the delay)."""
    calls = []

    def spy(attempt, *, base_s, cap_s=None):
        delay = backoff_delay(attempt, base_s=base_s, cap_s=cap_s)
        calls.append((attempt, base_s, cap_s, delay))
        return delay

    monkeypatch.setattr(module, "backoff_delay", spy)
    return calls


class Failing(Backend):
    async def generate(self, prompt_ids, sampling, session_id=None):
        raise ConnectionError("down")


def test_the_loop_retries_a_failing_backend_with_uncapped_doubling(monkeypatch):
    calls = recording(monkeypatch, loop)
    config = LoopConfig(backend_retries=3, retry_backoff_s=0.001)
    result, error = asyncio.run(loop._generate_with_retries(Failing(), [1], sampling(), "s", config))
    assert result is None and error == "ConnectionError: down"
    assert calls == [(a, 0.001, None, d) for a, d in enumerate(reference_delays(3, 0.001, None))]


def test_the_http_backend_backs_off_by_the_rule_at_start_and_per_request(monkeypatch):
    calls = recording(monkeypatch, openai_http)

    async def main():
        async with StubServer(fail_first=3).running() as server:
            async with openai_http.OpenAIHTTPBackend([server.url], MODEL, max_retries=3, backoff_s=0.001,
                                                     max_backoff_s=0.002) as backend:
                await backend.generate([1], sampling())
        dead = openai_http.OpenAIHTTPBackend([f"http://127.0.0.1:{vllm_server.free_port()}"], MODEL, max_retries=2,
                                             backoff_s=0.001, max_backoff_s=0.002)
        with pytest.raises(openai_http.ServersUnavailableError):
            await dead.start()

    asyncio.run(main())
    # three failed requests, then three failed starts (the last one raises instead of waiting)
    expected = [(a, 0.001, 0.002, d) for a, d in enumerate(reference_delays(3, 0.001, 0.002))]
    assert calls == expected + expected


def exponential_backoffs(path: Path) -> list[str]:
    """``2 ** x`` / ``x * 2**n`` with a variable exponent in ``path``'s code (docstrings and comments aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and isinstance(node.left, ast.Constant)
                and node.left.value == 2 and not isinstance(node.right, ast.Constant)):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_other_exponential_backoff_is_written():
    files = [p for folder in ("agent_loop", "trainer", "benchmarks", "examples", "scripts")
             for p in (ROOT / folder).rglob("*.py")]
    found = [hit for p in files for hit in exponential_backoffs(p)]
    assert found == ["agent_loop/backends/retry.py:10"]
