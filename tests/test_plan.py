"""The memory estimate behind `xsa-lm train`'s check and `xsa-lm plan`: hand-computed numbers, a measured CPU step."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import cli_in_process, refused_in_process
from xsa_lm.model import GPT, GPTConfig
from xsa_lm.train import memory
from xsa_lm.train import plan as plan_module

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
    tokens, d, V = 16 * 2048, 1536, 50304
    # per token and layer, bf16 autocast: two fp32 LayerNorm inputs and their stats, their bf16 outputs (the qkv and fc
    # inputs), the qkv output (v keeps it whole), q and k after RoPE, the attention output and its logsumexp, the MLP
    # hidden layer before and after GELU
    per_token_layer = 2 * 4 * d + 2 * 8 + 2 * 2 * d + 2 * 3 * d + 2 * 2 * d + 2 * d + 4 * 6 + 2 * 2 * 6144
    assert per_token_layer == 61_480
    outside = 2 * 8 + 2 * (4 * d + 8) + 2 * d  # token ids and targets, ln_emb and ln_f inputs, the head's input
    ddp = memory.estimate(PAPER_07B, V, 16, 2048, "bf16-mixed")
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * p, 4 * p, 8 * p)
    assert ddp.activations == tokens * (24 * per_token_layer + outside + 4 * V)  # + the fp32 log-probabilities
    assert ddp.transient == tokens * 2 * 4 * V  # their gradient and log_softmax backward's output
    fsdp = memory.estimate(PAPER_07B, V, 16, 2048, "bf16-mixed", strategy="fsdp", world_size=8)
    block = memory.block_parameters(PAPER_07B)
    # FSDP2 gathers fp32 parameters (no mixed-precision policy) and autocast copies them as under DDP
    assert fsdp.params == 4 * -(-p // 8) + (2 * block + V * d) * 4 and fsdp.weight_copies == ddp.weight_copies > 0
    assert fsdp.optimizer == 8 * -(-p // 8) and fsdp.grads == 4 * -(-p // 8) + block * 4
    checkpointed = memory.estimate(PAPER_07B, V, 16, 2048, "bf16-mixed", activation_checkpointing=True)
    # checkpointed: each block's fp32 input; the block recomputed in the backward (after the cross-entropy's
    # buffers are freed) or those buffers, the larger
    assert checkpointed.activations == tokens * (24 * 4 * d + outside + 4 * V)
    assert checkpointed.transient == tokens * max(2 * 4 * V, per_token_layer - 4 * V)
    # the largest micro-batch fits and one more does not
    kwargs = dict(model=PAPER_07B, vocab_size=V, block_size=2048, precision="bf16-mixed")
    largest = memory.largest_micro_batch(80 * memory.GIB, **kwargs)
    assert memory.estimate(micro_batch_size=largest, **kwargs).total <= 80 * memory.GIB
    assert memory.estimate(micro_batch_size=largest + 1, **kwargs).total > 80 * memory.GIB


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_the_chunked_loss_fits_a_larger_micro_batch(precision: str):
    """gpt2_124m at context 1024 in 80 GiB: the whole logits' three N x V buffers against one chunk's; the largest
    micro-batch fits and one more does not, though a chunk's memory stops growing with the micro-batch."""
    gpt2 = {"n_layer": 12, "d_model": 768, "n_head": 12, "head_dim": 64, "mlp_ratio": 4}
    kwargs = dict(model=gpt2, vocab_size=50304, block_size=1024, precision=precision)
    fit = plan_module.micro_batch_fit(80 * memory.GIB, **kwargs)
    assert fit["loss_chunk"] == plan_module.LOSS_CHUNK and fit["chunked_loss"] > 1.5 * fit["whole_logits"] > 0
    chunked = {**kwargs, "model": gpt2 | {"loss_chunk": plan_module.LOSS_CHUNK}}
    for name, args in (("whole_logits", kwargs), ("chunked_loss", chunked)):
        assert memory.estimate(micro_batch_size=fit[name], **args).total <= 80 * memory.GIB
        assert memory.estimate(micro_batch_size=fit[name] + 1, **args).total > 80 * memory.GIB
    one, two = (memory.estimate(micro_batch_size=m, **chunked) for m in (1, 2))  # 1024 and 2048 tokens
    assert one.transient == two.transient and one.activations < two.activations


def test_each_new_term_is_sized():
    """autocast's bf16 weight copies, the cross-entropy's three N x V fp32 buffers, DDP's buckets, compile."""
    p, V, d = memory.parameter_count(PAPER_07B, 50304), 50304, 1536
    tokens = 16 * 2048
    layernorms = 24 * 2 * d + 2 * d
    mixed = memory.estimate(PAPER_07B, V, 16, 2048, "bf16-mixed", world_size=8)
    assert mixed.weight_copies == 2 * (p - layernorms)  # every matmul weight, the tied head included, in bf16
    assert memory.estimate(PAPER_07B, V, 16, 2048, "32-true").weight_copies == 0
    # eager cross-entropy: the saved fp32 log-probabilities + their gradient + log_softmax backward's output
    head = memory.head_saved_per_token(PAPER_07B, V, compute=2, residual=4)
    assert head["cross_entropy"] + memory.cross_entropy_transient_per_token(V, compute=2) == 3 * 4 * V
    assert mixed.transient == tokens * 2 * 4 * V
    # DDP: gradients live in its buckets (gradient_as_bucket_view); without it the buckets are a second copy
    assert mixed.ddp_buckets == 0 and mixed.grads == 4 * p
    copied = memory.estimate(PAPER_07B, V, 16, 2048, "bf16-mixed", world_size=8, gradient_as_bucket_view=False)
    assert copied.ddp_buckets == 4 * p and copied.total == mixed.total + 4 * p
    assert memory.estimate(PAPER_07B, V, 16, 2048, "bf16-mixed", gradient_as_bucket_view=False).ddp_buckets == 0
    # compiled (as measured): the second residual kept as the bf16 attention branch (2 x d_model less), and a
    # cross-entropy of bf16 logits (saved) with two bf16 N x V buffers in its backward
    compiled = memory.estimate(PAPER_07B, V, 16, 2048, "bf16-mixed", world_size=8, compiled=True)
    assert mixed.activations - compiled.activations == tokens * (24 * 2 * d + (4 - 2) * V)
    assert compiled.transient == tokens * 2 * 2 * V and compiled.total < mixed.total
    # XSA: two fp32 numbers per token and head; eager, W_o stays fp32 (no bf16 copy)
    xsa = memory.estimate(PAPER_07B, V, 16, 2048, "bf16-mixed", world_size=8, exclusive=True)
    assert xsa.activations - mixed.activations == tokens * 24 * 2 * 4 * 6
    assert mixed.weight_copies - xsa.weight_copies == 2 * 24 * d * d
    # FSDP2 accumulating: the reduction waits for the step's last micro-batch, so every rank holds every unsharded
    # gradient in fp32 until then, instead of one block's
    one = memory.estimate(PAPER_07B, V, 16, 2048, "bf16-mixed", strategy="fsdp", world_size=8)
    four = memory.estimate(PAPER_07B, V, 16, 2048, "bf16-mixed", strategy="fsdp", world_size=8, accumulation=4)
    assert four.grads - one.grads == 4 * p - 4 * memory.block_parameters(PAPER_07B)


def saved_bytes(run, model: torch.nn.Module) -> int:
    """Storages autograd saves while `run` builds its graph, each once, the model's weights and buffers excluded."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


@pytest.mark.parametrize("attention", ["sa", "xsa"])
def test_saved_bytes_per_token_and_layer_match_a_real_block(attention: str):
    """A paper-shaped block (attention width = d_model, MLP 4x, 6 heads), scaled down, under CPU bf16 autocast:
    the per-token part is the difference between two lengths (the rest is autocast's weight copies)."""
    shape = {"n_layer": 1, "d_model": 384, "n_head": 6, "head_dim": 64, "mlp_ratio": 4}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape, vocab_size=64, block_size=256, attention=attention))
    block = model.blocks[0]

    def measure(T: int) -> int:
        x = torch.randn(1, T, shape["d_model"], requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return saved_bytes(lambda: block(x, model.rope_cos[:T], model.rope_sin[:T]), model)

    short, long = measure(64), measure(128)
    per_token = (long - short) / 64
    terms = memory.block_saved_per_token(shape, compute=2, residual=4, exclusive=attention == "xsa")
    assert abs(sum(terms.values()) / per_token - 1) < 0.02
    copies = memory.autocast_copies(
        shape, 0, "bf16-mixed", exclusive=attention == "xsa", compiled=False, checkpointing=False
    )
    assert abs(copies / (long - 128 * per_token) - 1) < 0.02


def plan_of(args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> tuple[dict, str]:
    """`xsa-lm plan <args> out=plan.json`, in this process: the JSON file and the printed table."""
    out = cli_in_process(["plan", *args, "out=plan.json", "overwrite=true"], tmp_path, tmp_path, monkeypatch, capsys)
    assert out.returncode == 0, out.stderr
    return json.loads((tmp_path / "plan.json").read_text()), out.stdout


def test_plan_of_a_composed_config_is_memorys_estimate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    args = ["model=paper_0.7b", "trainer=ddp", "trainer.devices=8", "micro_batch_size=16", "device_memory_gb=80"]
    args += ["data.block_size=2048", "tokenizer=gpt2", "attention=xsa", "compile=true", "global_batch_tokens=262144"]
    plan, _ = plan_of(args, tmp_path, monkeypatch, capsys)
    expected = memory.estimate(PAPER_07B, 50304, 16, 2048, "bf16-mixed", world_size=8, exclusive=True, compiled=True)
    assert plan["per_device_bytes"] == expected.as_dict() and expected.ddp_buckets == 0  # gradient_as_bucket_view
    plain, _ = plan_of([*args, "trainer.strategy=ddp"], tmp_path, monkeypatch, capsys)  # Lightning's default: off
    assert plain["per_device_bytes"]["ddp_buckets"] > 0


def test_plan_writes_the_json_and_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    args = ["model=paper_2.7b", "trainer=fsdp", "trainer.devices=8", "micro_batch_size=8", "data.block_size=2048"]
    args += ["global_batch_tokens=524288", "tokenizer=gpt2", "device_memory_gb=80"]
    plan, table = plan_of(args, tmp_path, monkeypatch, capsys)
    assert plan["strategy"] == "fsdp" and plan["devices"] == 8 and plan["accumulation"] == 4
    terms = {"params", "grads", "optimizer", "activations", "transient", "weight_copies", "ddp_buckets", "total"}
    assert set(plan["per_device_bytes"]) == terms
    fsdp, ddp = plan["strategies"]["fsdp"], plan["strategies"]["ddp"]
    assert fsdp["compiled_bytes"]["total"] < fsdp["eager_bytes"]["total"]
    assert fsdp["per_device_bytes"]["optimizer"] * 8 <= ddp["per_device_bytes"]["optimizer"] + 64  # sharded by 8
    assert plan["max_micro_batch_size"] == fsdp["max_micro_batch_size"] > ddp["max_micro_batch_size"]
    assert "| fsdp (trainer) | eager |" in table and "| fsdp (trainer) | compiled |" in table
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


GIBS = [("0", "0"), ("-1", "-1"), ("nan", "nan"), ("inf", "inf"), ("true", "True"), ("lots", "lots")]  # given, shown
REFUSALS = [([f"device_memory_gb={g}"], f"device_memory_gb={s} must be a positive number of GiB") for g, s in GIBS]
REFUSALS += [
    # `no` would plan with activation checkpointing
    (["activation_checkpointing=no", "device_memory_gb=1"], "activation_checkpointing=no must be true or false"),
    (["activation_checkpointing=maybe"], "activation_checkpointing=maybe must be true or false"),
    (["out=notes.txt/plan.json"], "out=notes.txt/plan.json: notes.txt is a file, not a folder; choose another path"),
    (["out=folder"], "out=folder is a directory: give the file to write, e.g. out=folder/plan.json"),
    (["out="], "out= is empty: give the file to write the plan to, e.g. out=plan.json, or leave out= out"),
    (["out=notes.txt"], "out=notes.txt exists: choose another path or add overwrite=true"),
    (["out=notes.txt", "overwrite=no"], "overwrite=no must be true or false"),  # `no` is a non-empty text
    (["model.loss_chunk=-1"], "model.loss_chunk=-1 must be >= 0 (0: the whole logits at once)"),
]


@pytest.mark.parametrize(("args", "message"), REFUSALS)
def test_plan_refusals(args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    """One line each, before anything is planned or written."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)  # the job's plan.log handler, which later tests in this process would write to
    assert refused_in_process(["plan", "model=tiny", *args], monkeypatch, capsys) == f"xsa-lm: error: {message}\n"
    assert (tmp_path / "notes.txt").read_text() == "mine" and not any((tmp_path / "folder").iterdir())


@pytest.mark.parametrize("vocab, peak", [(4096, "the cross-entropy's"), (64, "XSA's")])
def test_plan_names_xsa_memory_and_the_larger_transient(vocab: int, peak: str, tmp_path: Path, monkeypatch, capsys):
    """XSA's temporaries (one layer's backward, eager fp32: the gradients of z, y and v, 12 bytes per token and
    attention channel, and two numbers per head) count where they exceed the cross-entropy's buffers (2 fp32 N x V),
    as with a 64-token vocabulary."""
    args = ["model=tiny", "attention=xsa", f"model.vocab_size={vocab}", "device_memory_gb=1"]
    plan, text = plan_of(args, tmp_path, monkeypatch, capsys)
    positions = 16 * 128
    assert plan["xsa_temporaries_bytes"]["eager"] == positions * (3 * 4 * 128 + 2 * 4 * 4)
    assert plan["cross_entropy_transient_bytes"]["eager"] == positions * 2 * 4 * vocab
    assert plan["xsa_saved_bytes"] == 4 * positions * 2 * 4 * 4  # per layer, token and head: two fp32 numbers
    larger = max(plan["xsa_temporaries_bytes"]["eager"], plan["cross_entropy_transient_bytes"]["eager"])
    assert plan["per_device_bytes"]["transient"] == larger
    assert f"the backward peak is {peak}\n" in text


def test_plan_prints_the_sdpa_kernel_order_and_no_xsa_memory_for_sa(tmp_path: Path, monkeypatch, capsys):
    cpu, cpu_text = plan_of(["model=tiny", "trainer=cpu", "device_memory_gb=1"], tmp_path, monkeypatch, capsys)
    assert cpu["xsa_temporaries_bytes"]["eager"] == cpu["xsa_saved_bytes"] == 0
    assert "XSA's memory: none (attention sa)" in cpu_text
    gpu, gpu_text = plan_of(["model=tiny", "trainer=gpu", "device_memory_gb=1"], tmp_path, monkeypatch, capsys)
    assert cpu["sdpa_backends"] == {"setting": "auto", "device": "cpu", "order": ["flash", "math"]}
    assert "SDPA kernels on cpu (sdpa_backends=auto), the first that fits runs: flash, math\n" in cpu_text
    if not torch.cuda.is_available():  # planned here, resolved on the GPU
        assert gpu["sdpa_backends"]["order"] is None and "chosen on the run's GPU (none here)" in gpu_text
