"""The memory estimate behind `xsa-lm train`'s check and `xsa-lm plan`: hand-computed numbers, a measured CPU step."""

import json
from dataclasses import asdict
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from xsa_lm.bench.loops import PlainTrainer, Setup, make_batches, peak_memory
from xsa_lm.model import GPT, GPTConfig
from xsa_lm.train import memory
from xsa_lm.train.schedule import warmup_cosine_scheduler

TINY = {"n_layer": 4, "d_model": 128, "n_head": 4, "head_dim": 32, "mlp_ratio": 4}
PAPER_07B = {"n_layer": 24, "d_model": 1536, "n_head": 6, "head_dim": 256, "mlp_ratio": 4}


def test_parameters_by_hand_and_by_the_model():
    # tiny: a block is q, k, v, o (4 x 128 x 128), the MLP (2 x 128 x 512) and two LayerNorms (2 x 128)
    assert memory.block_parameters(TINY) == 4 * 128 * 128 + 2 * 128 * 512 + 2 * 128 == 196_864
    assert memory.parameter_count(TINY, 4096) == 4 * 196_864 + 4096 * 128 + 2 * 128 == 1_312_000
    # paper_0.7b: attention width 6 x 256 = 1536 = d_model, GPT-2's vocabulary padded to 50304
    assert memory.block_parameters(PAPER_07B) == 4 * 1536 * 1536 + 2 * 1536 * 6144 + 2 * 1536
    for shape, vocab in ((TINY, 4096), (PAPER_07B, 50304)):
        with torch.device("meta"):
            model = GPT(GPTConfig(**shape, vocab_size=vocab, block_size=128))
        assert memory.parameter_count(shape, vocab) == model.num_params(non_embedding=False)


def test_ddp_and_fsdp_bytes_by_hand():
    p = memory.parameter_count(PAPER_07B, 50304)
    tokens = 16 * 2048
    per_token_layer = 4 * 1536 + 6 * 1536 + 2 * 6144  # LayerNorms, q k v (+RoPE), attention out, MLP hidden x 2
    logits = tokens * 50304 * 4
    ddp = memory.estimate(PAPER_07B, 50304, 16, 2048, "bf16-mixed")
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * p, 4 * p, 8 * p)
    assert ddp.activations == 24 * tokens * per_token_layer * 2 + logits and ddp.transient == logits
    fsdp = memory.estimate(PAPER_07B, 50304, 16, 2048, "bf16-mixed", strategy="fsdp", world_size=8)
    block = memory.block_parameters(PAPER_07B)
    assert fsdp.params == 4 * -(-p // 8) + (2 * block + 50304 * 1536) * 2
    assert fsdp.optimizer == 8 * -(-p // 8) and fsdp.grads == 4 * -(-p // 8) + block * 2
    checkpointed = memory.estimate(PAPER_07B, 50304, 16, 2048, "bf16-mixed", activation_checkpointing=True)
    assert checkpointed.activations == tokens * (24 * 1536 + per_token_layer) * 2 + logits
    # the largest micro-batch fits and one more does not
    kwargs = dict(model=PAPER_07B, vocab_size=50304, block_size=2048, precision="bf16-mixed")
    largest = memory.largest_micro_batch(80 * memory.GIB, **kwargs)
    assert memory.estimate(micro_batch_size=largest, **kwargs).total <= 80 * memory.GIB
    assert memory.estimate(micro_batch_size=largest + 1, **kwargs).total > 80 * memory.GIB


@pytest.mark.parametrize("attention", ["sa", "xsa"])
@pytest.mark.parametrize("shape", [(4, 128, 4, 32, 4096, 16, 128), (2, 256, 8, 32, 512, 8, 256)])
def test_estimate_within_20_percent_of_a_measured_cpu_step(shape, attention):
    """Against bench's CPU count: weights, gradients, AdamW state and every tensor saved for the backward."""
    n_layer, d_model, n_head, head_dim, vocab, micro_batch, context = shape
    config = GPTConfig(
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        head_dim=head_dim,
        vocab_size=vocab,
        block_size=context,
        attention=attention,
    )
    setup = Setup(
        torch.device("cpu"),
        precision="32-true",
        compile=False,
        optimizer=partial(torch.optim.AdamW, lr=1e-3, fused=True),
        scheduler=partial(warmup_cosine_scheduler, warmup_steps=1, min_lr_ratio=0.1),
    )
    batches = make_batches(2, micro_batch=micro_batch, context=context, vocab=vocab, seed=0, pin=False)
    trainer = PlainTrainer(config, setup, seed=0, total_steps=4)
    trainer.run(batches, 1)  # the AdamW state exists from the first step on
    measured, _ = peak_memory(trainer, batches)
    e = memory.estimate(
        asdict(config), vocab_size=vocab, micro_batch_size=micro_batch, block_size=context, precision="32-true"
    )
    assert 0.8 <= (e.total - e.transient) / measured <= 1.2


@pytest.mark.slow
@pytest.mark.long
def test_plan_writes_the_json_and_the_table(tmp_path: Path, data_cache: Path):
    args = ["plan", "model=paper_2.7b", "trainer=fsdp", "trainer.devices=8", "micro_batch_size=8"]
    args += ["data.block_size=2048", "global_batch_tokens=524288", "tokenizer=gpt2", "device_memory_gb=80"]
    args.append("out=plan.json")
    out = run_cli(args, data_cache, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["strategy"] == "fsdp" and plan["devices"] == 8 and plan["accumulation"] == 4
    assert set(plan["per_device_bytes"]) == {"params", "grads", "optimizer", "activations", "transient", "total"}
    fsdp, ddp = plan["strategies"]["fsdp"], plan["strategies"]["ddp"]
    assert fsdp["per_device_bytes"]["optimizer"] * 8 <= ddp["per_device_bytes"]["optimizer"] + 64  # sharded by 8
    assert plan["max_micro_batch_size"] == fsdp["max_micro_batch_size"] > ddp["max_micro_batch_size"]
    assert "| fsdp (trainer) |" in out.stdout and [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    bad = run_cli(["plan", "device_memory_gb=0"], data_cache, tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("xsa-lm: error: device_memory_gb")
