"""The options of playing on OpenAI-compatible servers, declared once for every command that does
(``rollout --backend http``, ``train --server``); ``BackendSettings.from_options`` reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field

from agent_loop.backends.base import REQUEST_TIMEOUT_S, RETRY_DEADLINE_S


def server_url(url: str) -> str:
    """A server root URL (``http(s)://host[:port]``; a trailing ``/v1`` is dropped); ValueError otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) URL; give the server's root, e.g. http://127.0.0.1:8000")
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise ValueError("bad port; give the server's root, e.g. http://127.0.0.1:8000") from None
    root = url.strip().rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


@dataclass
class ServerOptions:
    """The options of playing on OpenAI-compatible servers (``rollout --backend http``, ``train --server``):
    declared once for every command."""

    server: Annotated[list[Annotated[str, AfterValidator(server_url)]], Field(
        description="server root URL (an OpenAI-compatible server, e.g. agent-loop serve; train pushes each new "
                    "policy to it, which needs VLLM_SERVER_DEV_MODE=1); repeat for several servers (rollout probes "
                    "them with GET /v1/models at start)", json_schema_extra={"allowed": "an http(s) URL, repeatable"})] = \
        field(default_factory=list)
    served_model_name: Annotated[str | None, Field(
        description="the model name the --server(s) serve (agent-loop serve's default: policy); unset: the "
                    "--model path")] = None
    retry_deadline_s: Annotated[float, Field(gt=0, description="--server: how long one request retries; all "
                                             "servers down this long stops the run")] = RETRY_DEADLINE_S
    request_timeout_s: Annotated[float, Field(gt=0, description="--server: seconds one attempt of a request may "
                                              "take before it is retried (the retry deadline bounds them "
                                              "all)")] = REQUEST_TIMEOUT_S

    def served_name(self, model_path: str) -> str:
        """The name requests ask the servers for."""
        return self.served_model_name or model_path
