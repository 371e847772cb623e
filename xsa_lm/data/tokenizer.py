"""Tokenizers: a byte-level BPE trained on the corpus, GPT-2's, or any tokenizer.json."""

import os
import socket
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from xsa_lm.errors import UserError

EOT = "<|endoftext|>"  # separates documents; GPT-2's own end-of-text token


def eot_id(tokenizer: Tokenizer) -> int:
    """EOT's id: every tokenizer a corpus is prepared with has one (preparing refuses a tokenizer without)."""
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise UserError(f"tokenizer: it has no {EOT} token to separate documents")
    return eot


def train_bpe(train_texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with EOT as its only special token, trained on the training split's documents."""
    if vocab_size < 257:
        raise UserError(f"tokenizer.vocab_size must be at least 257 (256 bytes + EOT), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(train_texts, trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:  # BPE stops when no pair of tokens repeats: a small corpus
        print(
            f"tokenizer: the corpus supports {tokenizer.get_vocab_size()} BPE tokens, fewer than "
            f"tokenizer.vocab_size={vocab_size}; the model uses {tokenizer.get_vocab_size()}"
        )
    return tokenizer


def load_tokenizer_file(path: str, train_texts: Iterable[str] | None = None) -> Tokenizer:
    """A saved tokenizer.json (train_texts is unused: its vocabulary is fixed)."""
    if not os.path.isfile(path):
        raise UserError(f"tokenizer.path: file not found: {path}")
    tokenizer = Tokenizer.from_file(path)
    if tokenizer.token_to_id(EOT) is None:
        raise UserError(f"tokenizer.path: {path} has no {EOT} token to separate documents")
    return tokenizer


def load_gpt2(
    path: str | None = None,
    repo_id: str = "openai-community/gpt2",
    timeout_s: float = 5.0,
    train_texts: Iterable[str] | None = None,
) -> Tokenizer:
    """GPT-2's tokenizer from a local tokenizer.json, the Hugging Face cache, or the hub (train_texts: unused).

    Without network this fails in seconds (instead of the hub client's ~25 s of retries).
    """
    if path:
        return load_tokenizer_file(path)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Tokenizer.from_file(hf_hub_download(repo_id, "tokenizer.json", local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if offline or not reachable("huggingface.co", 443, timeout_s):
        raise UserError(
            "tokenizer=gpt2 needs the Hugging Face hub, which is unreachable"
            + (" (HF_HUB_OFFLINE is set)" if offline else "")
            + ": pass tokenizer.path=/path/to/gpt2/tokenizer.json, or use tokenizer=bpe"
        )
    return Tokenizer.from_file(hf_hub_download(repo_id, "tokenizer.json"))


def reachable(host: str, port: int, timeout_s: float) -> bool:
    """A TCP connect with a short timeout: offline fails in seconds, not after the hub client's retries."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False
