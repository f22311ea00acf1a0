"""A child process of tests/models/test_builtin_registry.py: registers the fake built-in model given as JSON,
with a stand-in for the GGUF loader (the conversion's locking and writing are real), and prints its folder.

    python registry_worker.py SPEC_JSON LOG [FSIZE_LIMIT]

Each conversion appends this process's pid to LOG; FSIZE_LIMIT: RLIMIT_FSIZE in bytes (a full disk)."""

import json
import os
import resource
import signal
import sys
import time

from agent_loop import builtin_models
from agent_loop.model_folders import ModelError


class Saved:
    """What load_gguf returns here: objects that save a small file the way the real model and tokenizer do."""

    chat_template = None

    def __init__(self, log: str, name: str):
        self.log, self.name = log, name

    def save_pretrained(self, folder) -> None:
        if self.name == "model.safetensors":
            with open(self.log, "a") as handle:
                handle.write(f"{os.getpid()}\n")
            time.sleep(1.5)  # a slow conversion: the other process must wait for it, not start its own
        (folder / self.name).write_text(f"{self.name} by {os.getpid()}\n")


def main() -> int:
    spec = builtin_models.WheelModel(**json.loads(sys.argv[1]))
    log = sys.argv[2]
    if len(sys.argv) > 3:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
    builtin_models.BUILTIN_MODELS[spec.name] = spec
    builtin_models.load_gguf = lambda gguf, dtype: (Saved(log, "model.safetensors"), Saved(log, "tokenizer.json"))
    try:
        print(builtin_models.builtin_path(spec.name))
    except ModelError as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
