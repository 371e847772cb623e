"""Tokenizers: a byte-level BPE trained on the corpus, GPT-2's, or any tokenizer.json."""

import hashlib
import json
import os
import socket
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from xsa_lm.errors import UserError

EOT = "<|endoftext|>"  # separates documents; GPT-2's own end-of-text token
GPT2_REPO = "openai-community/gpt2"


def eot_id(tokenizer: Tokenizer, which: str = "tokenizer: it") -> int:
    """EOT's id: every tokenizer a corpus is prepared with has one (`which`: the tokenizer, in the refusal)."""
    if (eot := tokenizer.token_to_id(EOT)) is None:
        raise UserError(f"{which} has no {EOT} token to separate documents")
    return eot


def train_bpe(train_texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with EOT as its only special token, trained on the training split's documents."""
    if vocab_size < 257:
        raise UserError(f"tokenizer.vocab_size must be at least 257 (256 bytes + EOT), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(train_texts, trainer=trainer)
    if (n := tokenizer.get_vocab_size()) < vocab_size:  # BPE stops when no pair of tokens repeats: a small corpus
        fewer = f"fewer than tokenizer.vocab_size={vocab_size}"
        print(f"tokenizer: the corpus supports {n} BPE tokens, {fewer}; the model uses {n}")
    return tokenizer


def read_tokenizer(path: str | Path, key: str) -> Tokenizer:
    """The tokenizer.json at `path`, or one line naming `key` and the file (every tokenizer file is read here)."""
    data = _read_bytes(Path(path), key)
    try:
        json.loads(data)  # first: its errors say where the file stops being JSON
        tokenizer = Tokenizer.from_str(data.decode())
    except UnicodeDecodeError as e:
        why = f"is not a tokenizer.json (not UTF-8 text: invalid byte at offset {e.start})"
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno} ({e.msg}; a truncated or a plain-text file?)"
        why = f"is not a tokenizer.json: invalid JSON at {where}"
    except Exception as e:  # noqa: BLE001 - `tokenizers` raises a bare Exception for any JSON it cannot read
        why = f"is JSON but no tokenizer of the `tokenizers` library ({e})"
    else:
        eot_id(tokenizer, f"{key}: {path}")
        return tokenizer
    raise UserError(f"{key}: {path} {why}")


def _read_bytes(path: Path, key: str) -> bytes:
    if not path.is_file():
        raise UserError(f"{key}: file not found: {path}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"{key}: {path} cannot be read ({e.strerror})") from None


def file_sha256(path: str | Path, key: str) -> str:
    """The sha256 of a tokenizer file's bytes: the identity of a tokenizer (meta.json and checkpoints record it)."""
    return hashlib.sha256(_read_bytes(Path(path), key)).hexdigest()


def load_tokenizer_file(path: str, train_texts: Iterable[str] | None = None) -> Tokenizer:
    """A saved tokenizer.json (train_texts is unused: its vocabulary is fixed)."""
    return read_tokenizer(os.path.expanduser(path), "tokenizer.path")


def load_gpt2(path: str | None = None, train_texts: Iterable[str] | None = None) -> Tokenizer:
    """GPT-2's tokenizer from a local tokenizer.json, the Hugging Face cache, or the hub (train_texts: unused)."""
    if path:
        return load_tokenizer_file(path)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    alternative = "pass tokenizer.path=/path/to/gpt2/tokenizer.json"
    try:
        try:
            file = hf_hub_download(GPT2_REPO, "tokenizer.json", local_files_only=True)
        except LocalEntryNotFoundError:
            if (why := hub_unreachable("HF_HUB_OFFLINE")) is not None:
                raise UserError(
                    f"tokenizer=gpt2 needs the Hugging Face hub, which is unreachable{why}: {alternative}, or use "
                    "tokenizer=bpe"
                ) from None
            file = hf_hub_download(GPT2_REPO, "tokenizer.json")
    except OSError as e:  # the cache's folders (HF_HOME below a file), or the download (requests' errors too)
        cache = f"the Hugging Face cache cannot be used ({e.filename}: {e.strerror or e}): point HF_HOME at a writable"
        why = f"{cache} folder, or" if e.filename else f"the download failed ({type(e).__name__}: {str(e)[:150]}):"
        raise UserError(f"tokenizer=gpt2: {why} {alternative}") from None
    return read_tokenizer(file, "tokenizer=gpt2 (from the Hugging Face cache)")


def hub_unreachable(*offline_variables: str, timeout_s: float = 5.0) -> str | None:
    """Why the hub cannot be used, as a message's end: " (A/B is set)", "" (no TCP connect in timeout_s) or None."""
    if any(os.environ.get(v, "0").lower() in ("1", "true", "yes") for v in offline_variables):
        return f" ({'/'.join(offline_variables)} is set)"
    with suppress(OSError):
        socket.create_connection(("huggingface.co", 443), timeout=timeout_s).close()
        return None
    return ""


def token_byte_lengths(tokenizer: Tokenizer, size: int) -> list[int]:
    """The UTF-8 bytes each of `size` token ids stands for (0: special, or beyond the vocabulary), for bits per byte."""
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)  # a character of the token's string per byte
    lengths = [0] * size
    for i in range(min(size, tokenizer.get_vocab_size())):
        if (piece := tokenizer.id_to_token(i)) is not None and i not in special:
            lengths[i] = len(piece) if byte_level else len(tokenizer.decode([i]).encode("utf-8"))
    return lengths
