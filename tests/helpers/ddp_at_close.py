"""``python tests/helpers/ddp_at_close.py ARGV`` (under torchrun): ``agent-loop train ARGV`` in this rank, printing to
stderr, when the process group is destroyed, how many DistributedDataParallel wrappers are still alive. Any: a
reducer ends the process group later, joining gloo's threads with the GIL held (pytorch#56297: a rank that hangs at
exit now and then), so tests/training/test_distributed.py asserts 0 on every rank."""

import gc
import runpy
import sys

import agent_loop.training.distributed as distributed

close = distributed.close_data_parallel


def counted_close() -> None:
    from torch.nn.parallel import DistributedDataParallel

    alive = sum(isinstance(thing, DistributedDataParallel) for thing in gc.get_objects())
    print(f"DDP wrappers alive when the process group is destroyed: {alive}", file=sys.stderr, flush=True)
    close()


distributed.close_data_parallel = counted_close  # agent_loop.cli.train imports it when it trains
sys.argv = ["agent_loop.recipes", *sys.argv[1:]]
runpy.run_module("agent_loop.recipes", run_name="__main__")
