"""The weights as vLLM reads them: one safetensors file in a folder (``save_weights``), and the error a push
that was not taken raises (``WeightSyncError``).

Both sides import it from here: the in-process vLLM engine (``agent_loop.backends.vllm_engine``) and the
trainer's pushes to vLLM servers (``agent_loop.training.transports.vllm_servers``), neither reaching into the other.
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS_FILE = "model.safetensors"


class WeightSyncError(RuntimeError):
    """A vLLM engine or server did not take the new weights (the next rollouts would sample a stale policy)."""


def save_weights(state_dict: dict, directory: str | Path, dtype=None) -> Path:
    """Write ``state_dict`` as one safetensors file in ``directory`` (created), in ``dtype`` if given: what
    vLLM's ``reload_weights`` reads.

    Tensors that share memory (tied input and output embeddings) are written as copies, which vLLM's
    loader accepts (it skips the output head of a tied model)."""
    from safetensors.torch import save_file  # torch: the rollout path imports this module without it

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        if dtype is not None:
            tensor = tensor.to(dtype)
        tensor = tensor.to("cpu").contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        tensors[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    path = directory / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path
