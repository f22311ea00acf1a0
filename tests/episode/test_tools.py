"""Tool execution: schemas from functions, every bad input becomes an error record, calls run concurrently."""

import asyncio
import threading

import pytest

from agent_loop.episode.parsers import ParsedCall, parse_hermes
from agent_loop.episode.tools import ToolExecutor, tool_messages
from agent_loop.types import TOOL_ERROR_KINDS


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "2 + 3 * 4".
    """
    if set(expression) - set("0123456789+-*/() ."):
        raise ValueError(f"unsupported characters in {expression!r}")
    return str(eval(expression))


async def lookup(key: str, default: int = 0) -> int:
    """Look a key up.

    Args:
        key: The key.
        default: Returned when the key is missing.
    """
    return {"a": 1, "b": 2}.get(key, default)


def run(executor, calls, **kw):
    return asyncio.run(executor.execute(calls, **kw))


def test_schema_from_type_hints_and_docstring():
    ex = ToolExecutor([calculator, lookup])
    by_name = {s["function"]["name"]: s["function"] for s in ex.schemas}
    assert by_name["calculator"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert by_name["lookup"]["parameters"]["required"] == ["key"]
    assert "Look a key up." == by_name["lookup"]["description"]


def test_sync_and_async_tools_succeed_in_order():
    ex = ToolExecutor([calculator, lookup])
    records = run(ex, [ParsedCall("calculator", {"expression": "2+3*4"}), ParsedCall("lookup", {"key": "b"})], turn=3)
    assert [(r.name, r.result, r.error_kind, r.turn) for r in records] == [("calculator", "14", None, 3), ("lookup", "2", None, 3)]
    assert all(r.latency_s >= 0 for r in records)
    assert tool_messages(records) == [
        {"role": "tool", "name": "calculator", "tool_call_id": "call00000", "content": "14"},
        {"role": "tool", "name": "lookup", "tool_call_id": "call00001", "content": "2"}]


def test_each_bad_input_is_an_error_the_model_reads():
    ex = ToolExecutor([calculator, lookup])
    turn = parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expression": "1+"</tool_call>')
    calls = [*turn.errors,
             ParsedCall("foo", {}),
             ParsedCall("lookup", {"key": 5}),
             ParsedCall("lookup", {"key": "a", "extra": 1, "default": "x"}),
             ParsedCall("calculator", {"expression": "import os"})]
    records = run(ex, calls)
    assert [r.error_kind for r in records] == ["malformed_json", "unknown_tool", "invalid_arguments", "invalid_arguments", "exception"]
    assert set(r.error_kind for r in records) <= set(TOOL_ERROR_KINDS)
    assert records[0].arguments == turn.errors[0].raw and records[0].error.startswith("Error: malformed JSON")
    assert records[1].error == "Error: unknown tool 'foo'; available: calculator, lookup"
    assert "key" in records[2].error and "is not of type 'string'" in records[2].error
    assert records[3].error.startswith("Error: invalid arguments for 'lookup'")
    assert "ValueError" in records[4].error and "import os" in records[4].error
    assert all(r.result is None for r in records)
    assert [m["content"] for m in tool_messages(records)] == [r.error for r in records]


def test_hanging_tools_time_out_without_blocking_the_loop():
    release = threading.Event()

    def hangs_sync(x: int) -> str:
        """Hangs.

        Args:
            x: Anything.
        """
        release.wait(30)
        return "late"

    async def hangs_async(x: int) -> str:
        """Hangs.

        Args:
            x: Anything.
        """
        await asyncio.sleep(30)
        return "late"

    ex = ToolExecutor([hangs_sync, hangs_async, calculator])

    async def main():
        ticks = 0

        async def ticker():  # the event loop keeps running while the sync tool hangs in its thread
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        t = asyncio.create_task(ticker())
        records = await ex.execute([ParsedCall("hangs_sync", {"x": 1}), ParsedCall("hangs_async", {"x": 1}),
                                    ParsedCall("calculator", {"expression": "1+1"})], timeout_s=0.2)
        t.cancel()
        release.set()  # let the abandoned thread finish so the executor can shut down
        return records, ticks

    records, ticks = asyncio.run(main())
    assert [r.error_kind for r in records] == ["timeout", "timeout", None]
    assert records[0].error == "Error: tool 'hangs_sync' timed out after 0.2 s"
    assert records[2].result == "2"
    assert ticks > 3


def make_probe(max_seen: list, active: list, gate: asyncio.Event | None = None):
    async def probe(i: int) -> int:
        """Records how many probes run at once.

        Args:
            i: Index.
        """
        active[0] += 1
        max_seen[0] = max(max_seen[0], active[0])
        await asyncio.sleep(0.01)
        active[0] -= 1
        return i
    return probe


@pytest.mark.parametrize("max_parallel", [1, 2, 4])
def test_calls_overlap_up_to_max_parallel(max_parallel):
    max_seen, active = [0], [0]
    ex = ToolExecutor([make_probe(max_seen, active)])
    records = run(ex, [ParsedCall("probe", {"i": i}) for i in range(6)], max_parallel=max_parallel)
    assert [r.result for r in records] == [str(i) for i in range(6)]
    assert max_seen[0] == max_parallel


def test_sync_calls_run_concurrently_in_threads():
    barrier = threading.Barrier(3, timeout=5)

    def meet(i: int) -> int:
        """Waits until three calls are in flight at once (fails with BrokenBarrierError otherwise).

        Args:
            i: Index.
        """
        barrier.wait()
        return i

    records = run(ToolExecutor([meet]), [ParsedCall("meet", {"i": i}) for i in range(3)], max_parallel=3)
    assert [r.error_kind for r in records] == [None, None, None]


def test_max_parallel_must_be_positive():
    with pytest.raises(ValueError, match="max_parallel"):
        run(ToolExecutor([calculator]), [], max_parallel=0)
