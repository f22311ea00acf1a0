"""A verl ``BaseTool`` for the AgentLoop test (named in its verl tool config as ``verl_side_tools.CodeLookupTool``):
per-trajectory state from ``tools_kwargs[...]["create_kwargs"]``, a step reward, the lifecycle verl runs."""

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

RELEASED: list[str] = []  # instance ids released, so the test sees verl's lifecycle ran to the end


class CodeLookupTool(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.tables: dict[str, dict] = {}

    async def create(self, instance_id=None, create_kwargs=None, **kwargs):
        instance_id, response = await super().create(instance_id)
        self.tables[instance_id] = dict((create_kwargs or {}).get("table", {}))
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        table = self.tables[instance_id]
        key = parameters["key"]
        if key not in table:
            raise KeyError(f"no code for {key!r}")
        return ToolResponse(text=str(table[key])), float(self.config.get("step_reward", 0.0)), {}

    async def release(self, instance_id, **kwargs):
        self.tables.pop(instance_id, None)
        RELEASED.append(instance_id)
