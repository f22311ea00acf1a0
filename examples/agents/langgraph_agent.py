"""LangGraph's prebuilt ReAct agent with a LangChain tool, changed only in its base URL and model: ``agent``
awaits the graph (``.ainvoke``), ``invoke_agent`` runs it synchronously (``.invoke``, on a thread of its own).

    agent-loop rollout --agent examples/agents/langgraph_agent.py:agent --task arithmetic --episodes 16
    agent-loop rollout --agent examples/agents/langgraph_agent.py:invoke_agent --task arithmetic --episodes 16
"""

from __future__ import annotations

import warnings

from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent


def langchain_tools(row: dict) -> list[StructuredTool]:
    """The episode's tools as LangChain tools, with the task's own schemas (the prompt the model was taught on)."""
    functions = {fn.__name__: fn for fn in row["episode"].tools}
    return [StructuredTool.from_function(func=functions[s["function"]["name"]], name=s["function"]["name"],
                                         description=s["function"]["description"], args_schema=s["function"]["parameters"])
            for s in row["tools"]]


def make_agent(base_url: str, model: str, session_id: str, tools: list):
    llm = ChatOpenAI(base_url=base_url, model=model, api_key=session_id, max_retries=0)
    with warnings.catch_warnings():  # LangGraph 1.x: "moved to langchain.agents"; the prebuilt one still works
        warnings.simplefilter("ignore")
        return create_react_agent(llm, tools)


async def agent(base_url: str, model: str, session_id: str, row: dict):
    """``--agent`` entry point: the ReAct loop on the task's question; the task scores the final answer."""
    graph = make_agent(base_url, model, session_id, langchain_tools(row))
    await graph.ainvoke({"messages": [("user", row["messages"][-1]["content"])]}, config={"recursion_limit": 9})
    return None


def invoke_agent(base_url: str, model: str, session_id: str, row: dict):
    """The same agent, synchronous: ``.invoke`` blocks until the ReAct loop ends."""
    graph = make_agent(base_url, model, session_id, langchain_tools(row))
    graph.invoke({"messages": [("user", row["messages"][-1]["content"])]}, config={"recursion_limit": 9})
    return None
