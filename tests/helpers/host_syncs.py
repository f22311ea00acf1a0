"""A recorder of the tensor calls that make a CUDA stream wait for the host, for the "no host sync in hot
paths" tests (advantages, masking)."""

from torch.overrides import TorchFunctionMode


class HostSyncs(TorchFunctionMode):
    """Records the tensor methods that would make a CUDA stream wait for the host (item, tolist, bool, ...)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero", "cpu")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))
