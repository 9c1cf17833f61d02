"""The collectives a data-parallel worker uses besides the train step's own: joining the msrun
process group once, a barrier, and checking that every rank starts from the same step."""

# tested by: tests/clipms/parallel/test_launch.py

from __future__ import annotations

_DISTRIBUTED: tuple[int, int] | None = None


def init_distributed() -> tuple[int, int]:
    """Join the msrun process group once (HCCL on Ascend, NCCL on GPU, mccl on CPU, chosen by
    MindSpore from the device); returns (rank, group size)."""
    global _DISTRIBUTED
    if _DISTRIBUTED is None:
        from mindspore.communication import get_group_size, get_rank, init

        # No auto-parallel context: the train step averages gradients itself
        # (DistributedGradReducer) and the loss all-gathers features, so the graph stays the
        # single-device graph plus three collectives.
        init()
        _DISTRIBUTED = (get_rank(), get_group_size())
    return _DISTRIBUTED


def barrier() -> None:
    """Return once every rank of the group has called it: an all-gather of one number, read back
    (MindSpore's CPU collectives run only inside graphs, so this is the compiled Cell that
    `check_same_start` uses too)."""
    import mindspore as ms
    import numpy as np

    _gather_steps()(ms.Tensor(np.zeros(1, dtype=np.float32))).asnumpy()


def check_same_start(step: int) -> None:
    """Raise on every rank unless all ranks of the group start from the same step.

    Each rank resumes from the checkpoint folder it sees; on hosts that do not share that folder,
    node 0 would resume while the others start from scratch, and averaging their gradients would
    train garbage without any error. The steps are all-gathered (as float32, exact up to 2**24
    steps) by a compiled Cell: MindSpore's CPU collectives run only inside graphs.
    """
    import mindspore as ms
    import numpy as np

    steps = _gather_steps()(ms.Tensor(np.array([step], dtype=np.float32))).asnumpy()
    if len(set(steps.tolist())) > 1:
        raise RuntimeError(
            f"the {len(steps)} ranks resumed from different steps (this rank: {step}; all: "
            f"{[int(s) for s in steps]}): every host must see the same checkpoint folder (a "
            "shared filesystem), or start fresh with train.resume: never")


def _gather_steps() -> object:
    import mindspore as ms
    from mindspore import nn, ops

    class GatherSteps(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.all_gather = ops.AllGather()

        @ms.jit
        def construct(self, x: ms.Tensor) -> ms.Tensor:
            return self.all_gather(x)

    return GatherSteps()
