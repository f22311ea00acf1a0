"""A single-turn verifiers (v1) taskset defined here, no hub: tiny sums, scored by an exact-answer reward."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.metric
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for a, b in [(2, 3), (4, 1), (7, 2), (1, 1)]:
            yield SumTask(SumData(prompt=f"What is {a}+{b}?", system_prompt="Answer with the number only.",
                                  answer=str(a + b)), self.config.task)


__all__ = ["SumTaskset"]
