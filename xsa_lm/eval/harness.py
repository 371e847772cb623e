"""Our GPT behind lm-evaluation-harness's model interface: log-likelihoods, rolling log-likelihoods, generation."""

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from tokenizers import Tokenizer

from xsa_lm.data.tokenizer import eot_id
from xsa_lm.model import GPT, generate


class HarnessLM(LM):
    """Scores and generates with a trained GPT and the tokenizer it was trained with, batched, on CPU or GPU."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, batch_size: int = 16, device: str = "cpu") -> None:
        super().__init__()
        self.model, self.tokenizer = model.to(device).eval(), tokenizer
        self.batch_size, self._device = batch_size, device  # the harness reads it through its `device` property
        self.eot = eot_id(tokenizer)
        self.max_length = model.config.block_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Tokenize context + continuation together (as training saw text) and split at the context's tokens;
        trailing spaces of the context move to the continuation, as the harness's own models do."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, context_ids = self.encode(context + continuation), self.encode(context)
        return context_ids or [self.eot], whole[len(context_ids) :]

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """log P(continuation | context) and whether greedy decoding would produce it, for token-id pairs."""
        results = []
        for start in range(0, len(pairs), self.batch_size):
            batch = pairs[start : start + self.batch_size]
            inputs = [(context + continuation)[-(self.max_length + 1) :][:-1] for context, continuation in batch]
            width = max(map(len, inputs))
            x = torch.tensor([ids + [0] * (width - len(ids)) for ids in inputs], device=self.device)  # right padding
            logprobs = F.log_softmax(self.model(x).float(), dim=-1)  # causal: padding never reaches earlier positions
            for row, ((_, continuation), ids) in enumerate(zip(batch, inputs, strict=True)):
                n = len(continuation)
                predicted = logprobs[row, len(ids) - n : len(ids)]
                target = torch.tensor(continuation, device=self.device)
                total = predicted.gather(-1, target.unsqueeze(-1)).sum().item()
                results.append((total, bool((predicted.argmax(-1) == target).all())))
        return results

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.score([self.encode_pair(*request.args) for request in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        """The whole text's log-likelihood, in windows of the model's context (each window conditioned on EOT and
        the tokens before it, up to max_length)."""
        totals = []
        for request in requests:
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.encode(request.args[0]),
                prefix_token=self.eot,
                max_seq_len=self.max_length,
                context_len=1,
            )
            totals.append(sum(s for s, _ in self.score([lm_utils.make_disjoint_window(w) for w in windows])))
        return totals

    def generate_until(self, requests) -> list[str]:
        outputs = []
        for request in requests:
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            ids = (self.encode(context) or [self.eot])[-self.max_length :]
            tokens = generate(
                self.model,
                torch.tensor([ids], device=self.device),
                int(kwargs.get("max_gen_toks", 128)),
                temperature=temperature,
                vocab_size=self.tokenizer.get_vocab_size(),
            )
            text = self.tokenizer.decode(tokens[0, len(ids) :].tolist())
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
        return outputs
