"""Data pipeline benchmark on the bundled corpus -> a table and a JSON file.

1. Preparation: `prepare` (reading, splitting, chunking, tokenization, shard files, metadata) vs raw
   `Tokenizer.encode_batch` over the same documents with the same freshly loaded tokenizer (target: prepare >= 0.8x
   of raw tokens/s).
2. Loading: training windows per second from the shuffled, resumable stream (the DataLoader as training uses it)
   vs what the tiny model consumes per second in training steps on this machine (target: >= 50x).

    python scripts/bench_data.py --out bench_data.json [--quick]
"""

import argparse
import json
import platform
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from xsa_lm.data.datamodule import PackedWindows, ShuffledBatches
from xsa_lm.data.prepare import prepare
from xsa_lm.data.sources import ShakespeareCorpus
from xsa_lm.data.tokenizer import load_tokenizer_file, train_bpe
from xsa_lm.model import GPT, GPTConfig


def bench_prepare(workdir: Path, repeats: int, shard_documents: int) -> dict:
    source = ShakespeareCorpus(val_plays=["julius-caesar", "the-tempest"])
    texts = [text for _, text in source.documents()]
    tokenizer = train_bpe(texts, vocab_size=4096)
    tokenizer.save(str(workdir / "tokenizer.json"))
    load = partial(load_tokenizer_file, str(workdir / "tokenizer.json"))  # no training inside the timed part
    raw_s, prep_s = [], []
    for r in range(repeats):  # interleaved, best of `repeats`: the machine's noise hits both alike
        # A freshly loaded tokenizer, as preparation uses: BPE keeps a word cache that a reused instance has warm.
        fresh = load(train_texts=None)
        t0 = time.perf_counter()
        encodings = fresh.encode_batch(texts, add_special_tokens=False)
        raw_s.append(time.perf_counter() - t0)
        n_tokens = sum(len(e.ids) for e in encodings)
        del encodings, fresh  # ~100 MB of Encoding objects: freed so they do not slow down what is timed next
        t0 = time.perf_counter()
        data = prepare(source, load, workdir / f"prepared-{r}", {"bench": r}, shard_documents=shard_documents)
        prep_s.append(time.perf_counter() - t0)
    assert data.meta["train_tokens"] + data.meta["val_tokens"] == n_tokens + len(texts)  # + one EOT per document
    return {
        "documents": len(texts),
        "tokens": n_tokens,
        "raw_encode_tokens_per_s": n_tokens / min(raw_s),
        "prepare_tokens_per_s": n_tokens / min(prep_s),
        "prepare_over_raw": min(raw_s) / min(prep_s),
        "shard_documents": shard_documents,
        "data_dir": str(data.dir),
    }


def bench_loader(data_dir: Path, block_size: int, micro_batch: int, batches: int) -> float:
    from xsa_lm.data.prepare import load_prepared

    windows = PackedWindows(load_prepared(data_dir).shards("train"), block_size)
    loader = torch.utils.data.DataLoader(ShuffledBatches(windows, micro_batch, seed=0), batch_size=None)
    it = iter(loader)
    next(it)  # the first epoch's permutation
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * micro_batch / (time.perf_counter() - t0)


def bench_model_consumption(block_size: int, micro_batch: int, steps: int) -> float:
    """Windows per second the tiny model trains on (forward, backward, AdamW step), fp32 on this machine's CPU."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, d_model=128, n_head=4, head_dim=32, vocab_size=4096, block_size=block_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 4096, (micro_batch, block_size))
    for i in range(steps + 2):
        if i == 2:  # two warm-up steps
            t0 = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps * micro_batch / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_data.json")
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer repeats and batches")
    args = parser.parse_args()
    repeats, batches, steps = (1, 50, 2) if args.quick else (9, 2000, 20)
    block_size, micro_batch = 128, 32
    with tempfile.TemporaryDirectory() as tmp:
        prep = bench_prepare(Path(tmp), repeats, shard_documents=10_000)  # the default: 38 plays, one shard
        loader_windows_per_s = bench_loader(Path(prep.pop("data_dir")), block_size, micro_batch, batches)
    model_windows_per_s = bench_model_consumption(block_size, micro_batch, steps)
    result = {
        **prep,
        "loader_windows_per_s": loader_windows_per_s,
        "model_windows_per_s": model_windows_per_s,
        "loader_over_model": loader_windows_per_s / model_windows_per_s,
        "block_size": block_size,
        "micro_batch": micro_batch,
        "device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "quick": args.quick,
    }
    prepare_ratio = f"{result['prepare_over_raw']:.2f}x raw (target >= 0.8)"
    loader_ratio = f"{result['loader_over_model']:,.0f}x the model (target >= 50)"
    rows = [
        ("raw Tokenizer.encode_batch", f"{prep['raw_encode_tokens_per_s']:,.0f} tokens/s", ""),
        ("prepare (shards + metadata)", f"{prep['prepare_tokens_per_s']:,.0f} tokens/s", prepare_ratio),
        ("tiny model training", f"{model_windows_per_s:,.1f} windows/s", ""),
        ("loader (shuffled stream)", f"{loader_windows_per_s:,.0f} windows/s", loader_ratio),
    ]
    print(f"bench_data: Shakespeare, {prep['documents']} documents, {prep['tokens']:,} tokens; {result['device']}")
    for name, value, ratio in rows:
        print(f"  {name:<30}{value:>24}  {ratio}")
    Path(args.out).write_text(json.dumps(result, indent=2, default=float))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
