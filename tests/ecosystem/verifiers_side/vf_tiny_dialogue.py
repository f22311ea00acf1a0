"""A multi-turn verifiers (v1) environment defined here: an Env whose run() answers the assistant itself
(the v1 form of MultiTurnEnv.env_response) for a fixed number of rounds."""

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def said_word(self, task, trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        return sum(task.word in r for r in replies) / max(len(replies), 1)


class EchoTaskset(vf.Taskset[EchoTask]):
    def load(self):
        for word in ["apple", "river", "stone"]:
            yield EchoTask(EchoData(prompt=f"Say the word {word}.", word=word), self.config.task)


class EchoEnvConfig(vf.EnvConfig):
    assistant: vf.AgentConfig = vf.AgentConfig()
    rounds: int = 3
    raise_at: int = -1  # a round whose answer raises (the bad-input test: an env whose step raises)


class EchoEnv(vf.Env[EchoEnvConfig]):
    async def run(self, task, agents):
        async with agents.assistant.interaction(task) as chat:
            segment = await chat.turn()
            for round_ in range(1, self.config.rounds):
                if segment.terminated:
                    break
                if round_ == self.config.raise_at:
                    raise RuntimeError(f"round {round_} is broken")
                segment = await chat.turn(f"Round {round_}: you said {len(segment.last_reply)} characters. "
                                          f"Say {task.data.word} again.")


__all__ = ["EchoTaskset", "EchoEnv"]
