"""LR schedule values and optimizer parameter groups."""

import math
from functools import partial

import pytest
import torch

from xsa_lm.model import GPT, GPTConfig
from xsa_lm.train.module import LMModule, param_groups
from xsa_lm.train.schedule import warmup_cosine, warmup_cosine_scheduler

SMALL = GPTConfig(n_layer=1, d_model=16, n_head=2, head_dim=8, vocab_size=64, block_size=8)


def test_warmup_is_linear_then_cosine_reaches_min_ratio():
    f = partial(warmup_cosine, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    expected = {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 60: 0.1 + 0.9 * 0.5, 110: 0.1, 500: 0.1}  # 60: half-way down
    assert {step: f(step) for step in expected} == pytest.approx(expected)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_scheduler_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=6e-4)
    sched = warmup_cosine_scheduler(opt, total_steps=20, warmup_steps=4, min_lr_ratio=0.1)
    lrs = []
    for _ in range(21):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    halfway = 6e-5 + 5.4e-4 * 0.5 * (1 + math.cos(math.pi * 8 / 16))
    assert [lrs[0], lrs[3], lrs[12], lrs[20]] == pytest.approx([1.5e-4, 6e-4, halfway, 6e-5])


def test_weight_decay_only_on_matrices():
    model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, head_dim=16, vocab_size=64, block_size=8, bias=True))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert any("ln_" in names[id(p)] for p in no_decay["params"])
    assert any(names[id(p)].endswith("bias") for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))  # tied weight once


def test_module_builds_adamw_with_config_values():
    optimizer = partial(torch.optim.AdamW, lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    module = LMModule(SMALL, optimizer, partial(warmup_cosine_scheduler, warmup_steps=2, min_lr_ratio=0.1), 10)
    conf = module.configure_optimizers()
    opt = conf["optimizer"]
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert conf["lr_scheduler"]["interval"] == "step"
    assert opt.defaults["fused"]  # one kernel for all parameters, on CPU as on CUDA


@pytest.mark.parametrize("fused", [True, False])
def test_a_nonfinite_gradient_never_reaches_the_weights(fused: bool):
    scheduler = partial(warmup_cosine_scheduler, warmup_steps=1, min_lr_ratio=0.1)
    module = LMModule(SMALL, partial(torch.optim.AdamW, lr=1e-2, fused=fused), scheduler, total_steps=10)
    opt = module.configure_optimizers()["optimizer"]
    idx = torch.randint(0, 64, (2, 8))
    for poisoned in (False, True, False):
        before = [p.detach().clone() for p in module.parameters()]
        _, loss = module.model(idx, idx)
        (loss * float("nan") if poisoned else loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        module.skip_update_if_nonfinite(opt, grad_norm)
        opt.step()
        opt.zero_grad()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
        assert unchanged == poisoned
    assert all(torch.isfinite(p).all() for p in module.parameters())
    # fused: a device flag per step, read later (no sync); unfused: the bad step was read at once
    assert len(module._nonfinite) == (3 if fused else 1)
