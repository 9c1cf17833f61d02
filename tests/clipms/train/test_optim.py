"""AdamW (fused kernel + folded bias correction) against a numpy AdamW, the host schedule
(clipms.train.schedule), decay groups, and global-norm clipping, all on real MindSpore graphs."""

from __future__ import annotations

import math

import clipms  # noqa: F401  - sets MindSpore's environment before mindspore is imported

# isort: split
import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from clipms.train import optim, schedule


def numpy_adamw(params, grads_per_step, lrs, decayed, betas=(0.9, 0.98), eps=1e-6, wd=0.2):
    """torch.optim.AdamW's update rule, written out in float64 numpy."""
    params = [p.astype(np.float64).copy() for p in params]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs, strict=True), start=1):
        for i, g in enumerate(grads):
            if decayed[i]:
                params[i] *= 1 - lr * wd
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            m_hat = m[i] / (1 - betas[0] ** t)
            v_hat = v[i] / (1 - betas[1] ** t)
            params[i] -= lr * m_hat / (np.sqrt(v_hat) + eps)
    return params


class _Step(nn.Cell):
    def __init__(self, opt):
        super().__init__()
        self.opt = opt

    def construct(self, grads, lr, eps, wd):
        return self.opt(grads, lr, eps, wd)


@pytest.mark.slow  # compiles AdamW steps
def test_adamw_matches_numpy_reference_with_bias_correction():
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    init = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32)]
    params = [ms.Parameter(ms.Tensor(value), name=f"p{i}") for i, value in enumerate(init)]
    opt = optim.build_adamw(list(zip(["proj.weight", "proj.bias"], params, strict=True)))
    assert opt.decay_flags == (True, False)
    step = _Step(opt)
    lrs = [1e-2, 5e-2, 3e-2, 1e-3, 0.0, 2e-2]
    grads_seq = [[rng.normal(size=p.shape).astype(np.float32) * 10 ** rng.uniform(-4, 1)
                  for p in init] for _ in lrs]
    for t, (grads, lr) in enumerate(zip(grads_seq, lrs, strict=True), start=1):
        hyper = schedule.folded_hyper(lr, t)
        step(tuple(ms.Tensor(g) for g in grads), *(ms.Tensor(x) for x in hyper.tensors()))
    expected = numpy_adamw(init, grads_seq, lrs, decayed=[True, False])
    for param, ref in zip(params, expected, strict=True):
        np.testing.assert_allclose(param.asnumpy(), ref, rtol=2e-5, atol=2e-6)
    # Without the folded correction the same kernel is far off at step 1 (what nn.AdamWeightDecay
    # does): the test would catch a regression to it.
    raw = numpy_adamw(init, grads_seq[:1], lrs[:1], [True, False])[0]
    uncorrected = init[0] * (1 - lrs[0] * 0.2) - lrs[0] * 0.1 * grads_seq[0][0] / (
        np.sqrt(0.02 * grads_seq[0][0] ** 2) + 1e-6)
    assert np.abs(raw - uncorrected).max() > 1e-3


def test_schedule_warmup_then_cosine_to_zero():
    base, warmup, total = 1e-3, 10, 110
    lrs = [schedule.cosine_lr(s, base, warmup, total) for s in range(total + 1)]
    assert lrs[0] == pytest.approx(base / warmup)
    assert lrs[warmup - 1] == pytest.approx(base)
    assert all(a < b for a, b in zip(lrs[:warmup - 1], lrs[1:warmup], strict=True))
    assert lrs[warmup] == pytest.approx(base)
    assert lrs[warmup + 50] == pytest.approx(0.5 * base)  # half way through the cosine
    assert all(a >= b for a, b in zip(lrs[warmup:-1], lrs[warmup + 1:], strict=True))
    assert lrs[total] == pytest.approx(0.0, abs=1e-12)
    expected = 0.5 * (1 + math.cos(math.pi * 3 / 4)) * base
    assert schedule.cosine_lr(3, base, 0, 4) == pytest.approx(expected)


def test_folded_hyper_is_torch_adamw_step_one():
    hyper = schedule.folded_hyper(1e-3, 1)
    assert hyper.lr == pytest.approx(1e-3 * math.sqrt(0.02) / 0.1)
    assert hyper.eps == pytest.approx(1e-6 * math.sqrt(0.02))
    assert hyper.lr * hyper.weight_decay == pytest.approx(1e-3 * 0.2)  # decoupled decay lr*wd
    with pytest.raises(ValueError, match="step t"):
        schedule.folded_hyper(1e-3, 0)


def test_decay_groups_follow_open_clip_and_can_spare_the_embeddings():
    shapes = {
        "visual.conv1.weight": (256, 192),
        "visual.class_embedding": (256,),
        "visual.positional_embedding": (65, 256),
        "visual.ln_pre.gamma": (256,),
        "visual.ln_pre.beta": (256,),
        "visual.transformer.resblocks.0.attn.q_proj.weight": (256, 256),
        "visual.transformer.resblocks.0.attn.q_proj.bias": (256,),
        "visual.proj": (256, 256),
        "token_embedding.embedding_table": (4096, 256),
        "positional_embedding": (32, 256),
        "text_projection": (256, 256),
        "logit_scale": (),
    }
    matrices = ["visual.conv1.weight", "visual.transformer.resblocks.0.attn.q_proj.weight",
                "visual.proj", "text_projection"]
    embeddings = ["visual.positional_embedding", "token_embedding.embedding_table",
                  "positional_embedding"]
    decay, no_decay = optim.split_decay(shapes.items())  # open_clip: embedding tables decayed
    assert sorted(decay) == sorted(matrices + embeddings)
    assert sorted(no_decay) == sorted(["visual.class_embedding", "visual.ln_pre.gamma",
                                       "visual.ln_pre.beta", "logit_scale",
                                       "visual.transformer.resblocks.0.attn.q_proj.bias"])
    decay, no_decay = optim.split_decay(shapes.items(), decay_embeddings=False)
    assert sorted(decay) == sorted(matrices)
    assert set(embeddings) <= set(no_decay)


def test_the_real_model_decays_its_embedding_tables_by_default():
    from clipms.model.clip import CLIP
    from harness.tiny_model import tiny_config

    named = list(CLIP(tiny_config(vocab_size=50)).parameters_and_names())
    flags = dict(zip([n for n, _ in named], optim.build_adamw(named).decay_flags, strict=True))
    assert flags["text.token_embedding.embedding_table"] and flags["visual.positional_embedding"]
    assert not flags["visual.class_embedding"] and not flags["logit_scale"]
    assert not any(flag for name, flag in flags.items() if name.endswith((".gamma", ".beta")))
    spared = optim.build_adamw(named, decay_embeddings=False).decay_flags
    assert sum(spared) == sum(flags.values()) - 3  # token + 2 positional tables


def test_clip_by_global_norm_matches_numpy():
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=s).astype(np.float32) for s in [(5, 4), (4,), (3, 3)]]
    norm = float(np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads)))

    @ms.jit
    def clip(gs, max_norm):
        return optim.clip_by_global_norm(gs, max_norm)

    for max_norm in (norm / 4, norm * 2):
        clipped, got_norm = clip(tuple(ms.Tensor(g) for g in grads), max_norm)
        assert float(got_norm.asnumpy()) == pytest.approx(norm, rel=1e-5)
        factor = min(1.0, max_norm / (norm + 1e-6))
        for c, g in zip(clipped, grads, strict=True):
            np.testing.assert_allclose(c.asnumpy(), g * factor, rtol=1e-5, atol=1e-7)
        new_norm = float(np.sqrt(sum((c.asnumpy().astype(np.float64) ** 2).sum() for c in clipped)))
        assert new_norm == pytest.approx(min(norm, max_norm), rel=1e-4)
