"""CLIP in MindSpore, written bottom-up: attention -> block -> transformer -> towers -> CLIP.

The function is open_clip's CLIP ViT (same parameters, same maths), so open_clip weights convert
both ways (`clipms.model.convert`). Three layout choices differ from open_clip, each because it is
faster with MindSpore on CPU (measured; docs/model.md) and each a pure re-arrangement of the same
numbers:
- the patch embedding is a reshape + MatMul (`patch_embed`, a bias-free Dense over flattened
  (channel, row, column) patches) instead of a strided Conv2d;
- attention has three Dense layers q/k/v instead of one fused in_proj (slicing its output is slow);
- attention is BatchMatMul + softmax instead of a fused multi-head-attention kernel.
`vision.stem: conv` swaps the patch embedding for a convolutional stem (`ConvStem`): clipms's own
tower, not open_clip's, so such a model does not convert.

Static shapes and no Python control flow on tensor values, so GRAPH_MODE (and Ascend) compile it.
Shape letters: N batch, L sequence length, D width, H heads, E embed_dim.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Initializer, Normal, Uniform, initializer

from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
from clipms.model.patch_dropout import PatchDropout

# Added to masked attention scores. Finite (not -inf) so that Ascend kernels never see inf - inf,
# and within fp16's range (max 65504): under mixed precision the mask constant is cast to fp16,
# where -1e9 became -inf. Scores are far smaller, so exp() of a masked score underflows to exactly
# 0 in fp32 and the softmax equals open_clip's.
_MASKED = -3.0e4


def cast(x: Tensor, dtype: ms.dtype) -> Tensor:
    """x in dtype. Skips the Cast when the dtype already matches: a same-dtype Cast is not free
    on CPU (docs/model.md, "What differs"). dtypes are static, so graphs fold the test."""
    return x if x.dtype == dtype else x.astype(dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm over the last axis with open_clip's epsilon (1e-5; MindSpore's default is 1e-7),
    computed in fp32 and cast back to the input dtype, so mixed precision keeps it fp32."""

    def __init__(self, width: int):
        super().__init__((width,), epsilon=1e-5)

    def construct(self, x: Tensor) -> Tensor:
        y, _, _ = self.layer_norm(cast(x, ms.float32), self.gamma, self.beta)
        return cast(y, x.dtype)


class QuickGELU(nn.Cell):
    """x * sigmoid(1.702 x): the GELU approximation OpenAI's CLIP weights were trained with."""

    def construct(self, x: Tensor) -> Tensor:
        return x * ops.sigmoid(1.702 * x)


class GELU(nn.Cell):
    """Exact (erf) GELU, open_clip's default: x * (0.5 + 0.5 erf(x / sqrt 2)).

    Same function as nn.GELU(approximate=False) (nn.GELU() would be the tanh approximation), but
    faster on CPU (docs/model.md): MindSpore composes that one with a Div and two extra passes over
    the (N, L, 4D) activations, the largest tensors of the block."""

    def construct(self, x: Tensor) -> Tensor:
        return x * (0.5 + 0.5 * ops.erf(x * 0.7071067811865476))


def make_activation(quick_gelu: bool) -> nn.Cell:
    return QuickGELU() if quick_gelu else GELU()


def causal_mask(length: int) -> Tensor:
    """(L, L) additive mask: 0 on and below the diagonal, _MASKED above (a token sees its past)."""
    upper = ops.triu(ops.ones((length, length), ms.float32), diagonal=1)
    return upper * _MASKED


def torch_uniform(fan_in: int) -> Uniform:
    """PyTorch's default for nn.Linear / nn.Conv2d weights (kaiming_uniform, a=sqrt(5)) and biases
    alike: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return Uniform(fan_in**-0.5)


class Attention(nn.Cell):
    """Multi-head self-attention with open_clip's parameters (q/k/v are the thirds of in_proj).
    Biases start at zero, as nn.MultiheadAttention's in_proj_bias and out_proj.bias."""

    def __init__(self, width: int, heads: int, in_init: Initializer, out_init: Initializer):
        super().__init__()
        self.heads = heads
        self.head_dim = width // heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Dense(width, width, weight_init=in_init, bias_init="zeros")
        self.k_proj = nn.Dense(width, width, weight_init=in_init, bias_init="zeros")
        self.v_proj = nn.Dense(width, width, weight_init=in_init, bias_init="zeros")
        self.out_proj = nn.Dense(width, width, weight_init=out_init, bias_init="zeros")
        # q @ k^T with the transpose folded into the kernel: no transposed copy of k.
        self.scores = ops.BatchMatMul(transpose_b=True)

    def _split_heads(self, x: Tensor) -> Tensor:
        n, length, _ = x.shape
        return x.reshape(n, length, self.heads, self.head_dim).transpose(0, 2, 1, 3)  # (N,H,L,Dh)

    def construct(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        n, length, width = x.shape
        q = self._split_heads(self.q_proj(x) * self.scale)  # (N, H, L, Dh)
        k = self._split_heads(self.k_proj(x))  # (N, H, L, Dh)
        v = self._split_heads(self.v_proj(x))  # (N, H, L, Dh)
        scores = cast(self.scores(q, k), ms.float32)  # (N, H, L, L)
        if mask is not None:
            scores = scores + mask
        weights = cast(ops.softmax(scores, axis=-1), v.dtype)  # softmax in fp32
        out = ops.matmul(weights, v)  # (N, H, L, Dh)
        out = out.transpose(0, 2, 1, 3).reshape(n, length, width)  # (N, L, D)
        return self.out_proj(out)


class MLP(nn.Cell):
    """c_fc -> GELU -> c_proj. Biases start as nn.Linear's default (open_clip never resets them)."""

    def __init__(self, width: int, hidden: int, quick_gelu: bool, fc_init: Initializer,
                 proj_init: Initializer):
        super().__init__()
        self.c_fc = nn.Dense(width, hidden, weight_init=fc_init, bias_init=torch_uniform(width))
        self.gelu = make_activation(quick_gelu)
        self.c_proj = nn.Dense(hidden, width, weight_init=proj_init,
                               bias_init=torch_uniform(hidden))

    def construct(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (N, L, D) -> (N, L, 4D) -> (N, L, D)


class ResidualAttentionBlock(nn.Cell):
    """Pre-LN block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, width: int, heads: int, mlp_ratio: float, quick_gelu: bool, layers: int,
                 paper_init: bool):
        super().__init__()
        hidden = int(width * mlp_ratio)
        if paper_init:  # open_clip's TextTransformer.init_parameters (the CLIP paper's)
            proj = width**-0.5 * (2 * layers) ** -0.5
            qkv, out = Normal(width**-0.5), Normal(proj)
            fc, c_proj = Normal((2 * width) ** -0.5), Normal(proj)
        else:  # open_clip's VisionTransformer.init_parameters is a no-op: PyTorch's defaults,
            # xavier-uniform over the fused (3D, D) in_proj, nn.Linear's default elsewhere
            qkv, out = Uniform((6 / (width + 3 * width)) ** 0.5), torch_uniform(width)
            fc, c_proj = torch_uniform(width), torch_uniform(hidden)
        self.ln_1 = LayerNorm(width)
        self.attn = Attention(width, heads, qkv, out)
        self.ln_2 = LayerNorm(width)
        self.mlp = MLP(width, hidden, quick_gelu, fc, c_proj)

    def construct(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Cell):
    """`layers` blocks; paper_init: the text tower's CLIP-paper init, else the vision tower's."""

    def __init__(self, width: int, layers: int, heads: int, mlp_ratio: float, quick_gelu: bool,
                 paper_init: bool):
        super().__init__()
        self.resblocks = nn.CellList(
            [ResidualAttentionBlock(width, heads, mlp_ratio, quick_gelu, layers, paper_init)
             for _ in range(layers)]
        )

    def construct(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        for block in self.resblocks:
            x = block(x, mask)
        return x  # (N, L, D)


class ConvStem(nn.Cell):
    """(N, 3, g*p, g*p) -> (N, g*g, D) tokens through log2(p) stride-2 3x3 convolutions (padding
    1, no bias), each followed by a LayerNorm over the channels of each position and ReLU, then a
    1x1 convolution to the width (Xiao et al. 2021, "Early Convolutions Help Transformers See
    Better", with a per-sample norm for their BatchNorm: training and inference compute the same
    function). Channels double up to the width: 3 -> D/8 -> D/4 -> D/2 -> D for p = 16.

    Each convolution is im2col (ops.unfold) + a Dense whose weight is nn.Conv2d's (C_out, C_in, 3,
    3) flattened, initialised as nn.Conv2d's (U(+-1/sqrt(9 C_in))); the 1x1 is a Dense (weight
    and bias U(+-1/sqrt(C_in))). MindSpore's CPU Conv2d with its gradients costs several times
    this model's whole training step, im2col + MatMul a fraction of it (docs/model.md). The
    tokens come out in the patch embedding's order (row-major over the grid)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        width, channels = cfg.width, cfg.stem_channels
        pairs = list(zip(channels[:-1], channels[1:], strict=True))
        self.convs = nn.CellList([nn.Dense(9 * c_in, c_out, has_bias=False,
                                           weight_init=torch_uniform(9 * c_in))
                                  for c_in, c_out in pairs])
        self.norms = nn.CellList([LayerNorm(c_out) for _, c_out in pairs])
        self.proj = nn.Dense(channels[-1], width, weight_init=torch_uniform(channels[-1]),
                             bias_init=torch_uniform(channels[-1]))

    def construct(self, image: Tensor) -> Tensor:
        x = image  # (N, C, H, W)
        for conv, norm in zip(self.convs, self.norms):  # noqa: B905 (graph mode: no strict=)
            n, side = x.shape[0], x.shape[2] // 2
            cols = ops.unfold(x, 3, 1, 1, 2).transpose(0, 2, 1)  # (N, side*side, 9C): (c, y, x)
            y = ops.relu(norm(conv(cols)))  # (N, side*side, C_out), channels last
            x = y.transpose(0, 2, 1).reshape(n, -1, side, side)  # (N, C_out, side, side)
        x = x.reshape(x.shape[0], x.shape[1], -1).transpose(0, 2, 1)  # (N, g*g, C): row-major
        return self.proj(x)  # (N, g*g, D)


def _normal(shape: tuple[int, ...], std: float) -> Parameter:
    return Parameter(initializer(Normal(std), shape, ms.float32))


class VisionTransformer(nn.Cell):
    """Image (N, 3, H, W) -> (N, E): patches + class token -> transformer -> ln_post(cls) @ proj."""

    def __init__(self, cfg: VisionConfig, embed_dim: int, quick_gelu: bool):
        super().__init__()
        width, p = cfg.width, cfg.patch_size
        self.grid = cfg.grid_size
        self.patch = p
        self.width = width
        scale = width**-0.5  # open_clip's init scale for class/positional embedding and proj
        self.conv_stem = cfg.stem == "conv"  # vision.stem 'conv': ConvStem, no patch_embed
        if self.conv_stem:
            self.stem = ConvStem(cfg)
        else:  # Same numbers as open_clip's conv1.weight (D, 3, p, p), stored as (D, 3*p*p);
            # initialised as that nn.Conv2d by PyTorch (fan_in 3*p*p).
            self.patch_embed = nn.Dense(3 * p * p, width, has_bias=False,
                                        weight_init=torch_uniform(3 * p * p))
        self.class_embedding = _normal((width,), scale)
        self.positional_embedding = _normal((cfg.num_tokens, width), scale)
        # training forwards only, once the trainer seeds it (clipms.model.patch_dropout)
        self.patch_dropout = (PatchDropout(cfg.patch_dropout, cfg.grid_size**2)
                              if cfg.patch_dropout > 0 else None)
        self.ln_pre = LayerNorm(width)
        self.transformer = Transformer(width, cfg.layers, cfg.heads, cfg.mlp_ratio, quick_gelu,
                                       paper_init=False)
        self.ln_post = LayerNorm(width)
        self.proj = _normal((width, embed_dim), scale)

    def construct(self, image: Tensor) -> Tensor:
        n = image.shape[0]
        x = self.stem(image) if self.conv_stem else self._patches(image)  # (N, g*g, D)
        cls = ops.broadcast_to(cast(self.class_embedding, x.dtype).reshape(1, 1, -1),
                               (n, 1, self.width))
        x = ops.cat((cls, x), axis=1) + cast(self.positional_embedding, x.dtype)  # (N, L, D)
        if self.patch_dropout is not None:
            x = self.patch_dropout(x)  # (N, 1 + kept, D) in training
        x = self.transformer(self.ln_pre(x))  # (N, L, D)
        pooled = self.ln_post(x[:, 0])  # (N, D); per-token LN, so pooling first is the same
        return ops.matmul(pooled, cast(self.proj, pooled.dtype))  # (N, E)

    def _patches(self, image: Tensor) -> Tensor:
        n, g, p = image.shape[0], self.grid, self.patch
        # (N, 3, g*p, g*p) -> (N, g*g, 3*p*p): each patch flattened in conv-weight order (c, y, x)
        x = image.reshape(n, 3, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, g * g, 3 * p * p)
        return self.patch_embed(x)  # (N, g*g, D)


class TextTransformer(nn.Cell):
    """Tokens (N, ctx) int -> (N, E): causal transformer, pooled at the EOT token (highest id)."""

    def __init__(self, cfg: TextConfig, embed_dim: int, quick_gelu: bool):
        super().__init__()
        self.token_embedding = nn.Embedding(
            cfg.vocab_size, cfg.width, embedding_table=Normal(0.02)
        )
        self.positional_embedding = _normal((cfg.context_length, cfg.width), 0.01)
        self.transformer = Transformer(cfg.width, cfg.layers, cfg.heads, cfg.mlp_ratio, quick_gelu,
                                       paper_init=True)
        self.ln_final = LayerNorm(cfg.width)
        self.text_projection = _normal((cfg.width, embed_dim), cfg.width**-0.5)
        self.attn_mask = causal_mask(cfg.context_length)  # a constant, not a parameter

    def construct(self, text: Tensor) -> Tensor:
        n = text.shape[0]
        x = self.token_embedding(text)  # (N, L, D)
        x = x + cast(self.positional_embedding, x.dtype)
        x = self.ln_final(self.transformer(x, self.attn_mask))  # (N, L, D)
        # EOT is the highest id, so argmax finds it (ids < 2**24 are exact in float32).
        eot = ops.argmax(text.astype(ms.float32), dim=-1).astype(ms.int32)  # (N,)
        rows = ops.arange(n, dtype=ms.int32)
        pooled = ops.gather_nd(x, ops.stack((rows, eot), axis=-1))  # (N, D)
        return ops.matmul(pooled, cast(self.text_projection, pooled.dtype))  # (N, E)


def l2_normalize(x: Tensor) -> Tensor:
    """x / max(||x||, 1e-12) along the last axis (as torch.nn.functional.normalize), in float32
    whatever x's dtype: in fp16 the epsilon underflows to 0 (a zero vector becomes NaN) and a
    norm past 256 overflows (its square passes fp16's 65504). open_clip's autocast keeps it fp32."""
    x = cast(x, ms.float32)
    norm = ops.sqrt(ops.sum(x * x, dim=-1, keepdim=True))
    return x / ops.maximum(norm, 1e-12)


class CLIP(nn.Cell):
    """open_clip's CLIP ViT. `logit_scale` holds log(1/temperature); construct returns its exp.
    `logit_bias` (None unless `init_logit_bias` is set) is SigLIP's learned bias, open_clip's
    `logit_bias`: the loss reads it (clipms.train.step.ClipWithLoss), as does a bundle's
    `/v1/rank`."""

    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        self.config = cfg
        self.visual = VisionTransformer(cfg.vision, cfg.embed_dim, cfg.quick_gelu)
        self.text = TextTransformer(cfg.text, cfg.embed_dim, cfg.quick_gelu)
        self.logit_scale = Parameter(Tensor(cfg.init_logit_scale, ms.float32))
        self.logit_bias = (None if cfg.init_logit_bias is None else  # SigLIP's learned bias
                           Parameter(Tensor(cfg.init_logit_bias, ms.float32)))

    def encode_image(self, image: Tensor, normalize: bool = False) -> Tensor:
        features = self.visual(image)  # (N, E)
        return l2_normalize(features) if normalize else features

    def encode_text(self, text: Tensor, normalize: bool = False) -> Tensor:
        features = self.text(text)  # (N, E)
        return l2_normalize(features) if normalize else features

    def construct(self, image: Tensor, text: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        image_features = self.encode_image(image, normalize=True)
        text_features = self.encode_text(text, normalize=True)
        return image_features, text_features, ops.exp(self.logit_scale)


def to_mixed_precision(net: nn.Cell, dtype: ms.dtype = ms.float16) -> nn.Cell:
    """MindSpore's O2 mixed precision, in place and without renaming anything: every Cell of the
    towers computes in `dtype` (its inputs and parameters are cast when used; the fp32 Parameters
    stay the master weights), except LayerNorm, which stays fp32. Softmax is fp32 inside
    `Attention`. The CLIP Cell itself is left out, so what it does with the towers' outputs --
    the L2 normalisation (`l2_normalize`) and exp(logit_scale) -- runs in fp32 on the fp32
    parameter, and the loss gets fp32 features and scale, as under open_clip's autocast.

    `mindspore.amp.auto_mixed_precision(net, "O2")` does the same, but wraps each LayerNorm in a
    Cell of its own, so the parameters are then named `..._backbone.gamma` and a checkpoint saved
    from the model no longer loads into `CLIP`. `Cell.to_float` only sets flags, so the Cell tree
    and the parameter names stay the model's own.
    """
    towers = [net.visual, net.text] if isinstance(net, CLIP) else [net]
    for tower in towers:
        tower.to_float(dtype)
    for _, cell in net.cells_and_names():
        if isinstance(cell, nn.LayerNorm):
            cell.to_float(ms.float32)
    return net


def count_parameters(net: nn.Cell) -> int:
    return sum(int(p.size) for p in net.get_parameters())
