"""A synchronous ``--agent`` that rewrites its history once on even episodes (issue 54's new-user check).

It asks once; on an even episode it then replaces the whole exchange by a short summary (as context-compressing
agents do) and asks again, so the proxy records two segments of one session. Its reward is a fixed number per
episode (:func:`session_reward`), so a test knows every session-level advantage in advance.
"""

from openai import OpenAI


def session_reward(index: int) -> float:
    """The reward the agent reports for episode ``index``."""
    return round(0.1 + 0.077 * index, 3)


def agent(base_url: str, model: str, session_id: str, row: dict) -> float:
    client = OpenAI(base_url=base_url, api_key=session_id, max_retries=0)
    messages = list(row["messages"])
    client.chat.completions.create(model=model, messages=messages, tools=row["tools"], max_tokens=8)
    if row["index"] % 2 == 0:  # summarise: the rewritten history starts a new segment
        summary = [*messages, {"role": "user", "content": "Summary so far: nothing yet. Answer now."}]
        client.chat.completions.create(model=model, messages=summary, tools=row["tools"], max_tokens=8)
    return session_reward(row["index"])
