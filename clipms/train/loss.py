"""The contrastive losses: `ClipLoss`, the symmetric InfoNCE of open_clip's ClipLoss, and
`SigLipLoss`, the pairwise sigmoid loss of open_clip's SigLipLoss (Zhai et al. 2023);
`build_loss` makes the one `train.loss` names (clipms.train.recipe.LOSS_INIT: what each one's
model starts from).

With data parallelism each rank sees only its own batch. `gather=True` all-gathers the features of
every rank (AllGather's gradient is a reduce-scatter, so gradients flow back to the rank that made
each feature: open_clip's `gather_with_grad`) and scores the local rows against the global columns
(open_clip's `local_loss=True`). The mean of the ranks' losses is then exactly the single-process
loss of the global batch, which is what averaging gradients across ranks optimises.

The cross entropy is LogSoftmax + the positive pair's entry, not `ops.cross_entropy`: MindSpore
expands that one into Exp/ReduceSum/Log ops, and its CPU Log kernel's result for the (n, 1) row
sums depends on how many times that kernel has run (it re-splits its work across threads over its
first launches, and the split decides which rows take a vectorised path), so a resumed process
logged a loss one float32 ulp away from the uninterrupted run's (docs/training.md, "Bitwise
resume"). The weights were never affected (that Log feeds only the loss value, not a gradient).
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops


def contrastive_loss(
    image_features: Tensor,
    text_features: Tensor,
    all_image_features: Tensor,
    all_text_features: Tensor,
    logit_scale: Tensor,
    rank: int = 0,
) -> Tensor:
    """Loss of one rank's local batch (n rows) against the global batch (R*n columns).

    Features are L2-normalised; `logit_scale` is the exp'd scale (as the model returns it).
    Row i of this rank is the positive pair of global column rank*n + i. With rank=0 and
    all_* = the local features this is the ordinary single-process CLIP loss.
    """
    n = image_features.shape[0]
    logits_per_image = logit_scale * ops.matmul(image_features, all_text_features.T)  # (n, R*n)
    logits_per_text = logit_scale * ops.matmul(text_features, all_image_features.T)  # (n, R*n)
    labels = (ops.arange(n, dtype=ms.int32) + rank * n).reshape(n, 1)  # (n, 1)
    image_to_text = _cross_entropy(logits_per_image, labels)
    text_to_image = _cross_entropy(logits_per_text, labels)
    return (image_to_text + text_to_image) / 2


def _cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """mean_i -log softmax(logits_i)[labels_i] for (n, C) logits and (n, 1) int32 labels."""
    log_probs = ops.log_softmax(logits, 1)
    return -ops.mean(ops.gather_elements(log_probs, 1, labels))


def _gathering_rank(loss: str) -> int:
    """This process's rank, for a loss that gathers across ranks: get_rank() quietly answers 0
    before init(), and the AllGather would then fail late, so say so now."""
    from mindspore.communication import GlobalComm, get_rank

    if not GlobalComm.INITED:
        raise RuntimeError(f"{loss}(gather=True) needs mindspore.communication.init() first "
                           "(launch the script with msrun)")
    return get_rank()


class ClipLoss(nn.Cell):
    """`construct(image_features, text_features, logit_scale) -> scalar loss` (CLIP's outputs)."""

    def __init__(self, gather: bool = False):
        super().__init__()
        self.gather = gather
        self.rank = _gathering_rank(type(self).__name__) if gather else 0
        if gather:
            self.all_gather = ops.AllGather()  # concatenates ranks along axis 0, rank order

    def construct(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor):
        if self.gather:
            all_image = self.all_gather(image_features)
            all_text = self.all_gather(text_features)
        else:
            all_image, all_text = image_features, text_features
        return contrastive_loss(
            image_features, text_features, all_image, all_text, logit_scale, self.rank
        )


# ---- SigLIP ------------------------------------------------------------------------------------

def sigmoid_loss(image_features: Tensor, all_text_features: Tensor, logit_scale: Tensor,
                 logit_bias: Tensor, rank: int = 0) -> Tensor:
    """SigLIP's loss of one rank's n images against the global batch's R*n texts: every pair
    (i, j) is a binary problem, label +1 for the positive pair (global column rank*n + i) and -1
    for the rest, `-sum log sigmoid(label * (scale * <i, j> + bias)) / n`. With rank=0 and the
    local texts as all texts this is open_clip's SigLipLoss of one process.

    Texts are the only features that need gathering: each pair is counted once, on the rank that
    holds its image. Summed over ranks, the pairs are exactly the global batch's, and the mean of
    the ranks' losses (what averaging their gradients optimises) is the single-process loss of the
    global batch, as for `contrastive_loss`.
    """
    n = image_features.shape[0]
    logits = logit_scale * ops.matmul(image_features, all_text_features.T) + logit_bias  # (n, Rn)
    columns = ops.arange(logits.shape[1], dtype=ms.int32).reshape(1, -1)
    positives = (ops.arange(n, dtype=ms.int32) + rank * n).reshape(n, 1)
    labels = ops.select(columns == positives, ops.ones_like(logits), -ops.ones_like(logits))
    return -ops.sum(_log_sigmoid(labels * logits)) / n


def _log_sigmoid(x: Tensor) -> Tensor:
    """log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)), finite for every x (as F.logsigmoid)."""
    return ops.minimum(x, 0.0) - ops.log1p(ops.exp(-ops.abs(x)))


class SigLipLoss(nn.Cell):
    """`construct(image_features, text_features, logit_scale, logit_bias) -> scalar loss`.

    Data parallel (`gather=True`): each rank all-gathers the texts and scores its images against
    all of them, open_clip's `dist_impl="gather"`. open_clip's default (`bidir`) passes texts
    between neighbouring ranks instead, R-1 point-to-point rounds that never hold more than three
    ranks' texts, which matters at thousands of ranks. MindSpore 2.10's CPU backend has graph
    kernels for AllGather and AllReduce only (no Send/Receive, no ReduceScatter: why
    `clipms.train.step.AllGatherSumGrad` exists), so the exchange could not run here, while the
    all-gather is one collective on every backend, reuses the softmax loss's tested gather and
    gradient, and moves half of what that loss moves (texts only). The (n, R*n) logits it builds
    are small at the rank counts a MindSpore job uses. Loss and gradients are the same either way.
    """

    def __init__(self, gather: bool = False):
        super().__init__()
        self.gather = gather
        self.rank = _gathering_rank(type(self).__name__) if gather else 0
        if gather:
            self.all_gather = ops.AllGather()

    def construct(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor,
                  logit_bias: Tensor):
        all_text = self.all_gather(text_features) if self.gather else text_features
        return sigmoid_loss(image_features, all_text, logit_scale, logit_bias, self.rank)


def build_loss(kind: str, gather: bool = False) -> nn.Cell:
    """The loss `train.loss` names."""
    if kind == "clip":
        return ClipLoss(gather=gather)
    if kind == "siglip":
        return SigLipLoss(gather=gather)
    raise ValueError(f"train.loss={kind!r} is not one of ['clip', 'siglip']")
