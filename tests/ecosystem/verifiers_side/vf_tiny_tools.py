"""A tool verifiers (v1) taskset defined here: a Toolset (an MCP server of verifiers') with one calculator tool."""

import verifiers.v1 as vf


class CalcData(vf.TaskData):
    answer: str


class Calculator(vf.Toolset):
    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class CalcTask(vf.Task[CalcData]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(task.answer in trace.last_reply)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace) -> float:
        return float(len(trace.tool_messages) > 0)


class CalcTaskset(vf.Taskset[CalcTask]):
    def load(self):
        for a, b in [(12, 30), (5, 9), (100, 23)]:
            yield CalcTask(CalcData(prompt=f"Use the add tool: what is {a}+{b}?", answer=str(a + b)), self.config.task)


__all__ = ["CalcTaskset"]
