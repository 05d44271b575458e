"""Token sampling for one engine step: greedy, temperature, top-k and top-p, batched.

Split out of engine.py so the engine file keeps one job (the loop and the prefix cache).
Sampling uses the exponential-race trick (argmax of p / E with E ~ Exp(1)), which draws
exactly from p. A request with a seed draws its noise from a generator seeded with
(seed, number of tokens it has generated), so its samples depend neither on the rest of
the batch nor on a step that failed and was retried, nor on preemption.
"""
from __future__ import annotations

import struct

import torch
import xxhash

from scheduler import Sequence


def noise_seed(seed: int, position: int) -> int:
    """A generator seed for one sampled position of a seeded request."""
    return xxhash.xxh3_64_intdigest(struct.pack("<qq", seed, position)) >> 1


class Sampler:
    def __init__(self, device: torch.device, seed: int | None) -> None:
        self.device = device
        self.request_generator = torch.Generator(device=device)
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]):
        """logits: float32 [B, V]. Returns (token ids as a list, per-row logprob dicts or None)."""
        params = [s.sampling_params for s in seqs]
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            tokens = greedy
        else:
            tokens = torch.where(self._tensor([p.greedy for p in params], torch.bool),
                                 greedy, self._sample(logits, seqs))
        token_list = tokens.tolist()
        return token_list, self._logprobs(logits, seqs, token_list)

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.sampling_params for s in seqs]
        temperature = self._tensor([p.temperature or 1.0 for p in params], torch.float32)
        probs = self._filtered_probs(logits / temperature[:, None], params)
        return (probs / self._exponential_noise(seqs, probs.shape[-1])).argmax(dim=-1)

    def _filtered_probs(self, logits: torch.Tensor, params) -> torch.Tensor:
        """Softmax after top-k and top-p, both applied on one descending sort."""
        vocab = logits.shape[-1]
        if all(p.top_k == -1 and p.top_p == 1.0 for p in params):
            return logits.softmax(dim=-1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        top_k = self._tensor([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params],
                             torch.int64)
        rank = torch.arange(vocab, device=self.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        top_p = self._tensor([p.top_p for p in params], torch.float32)
        # Keep a token while the mass before it is below top_p (the top token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
        return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)

    def _exponential_noise(self, seqs: list[Sequence], vocab: int) -> torch.Tensor:
        noise = torch.empty(len(seqs), vocab, device=self.device)
        noise.exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            seed = seq.sampling_params.seed
            if seed is not None and not seq.sampling_params.greedy:
                self.request_generator.manual_seed(noise_seed(seed, seq.num_output_tokens))
                noise[row].exponential_(generator=self.request_generator)
        return noise

    @staticmethod
    def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]):
        wanted = [s.sampling_params.logprobs for s in seqs]
        if all(n is None for n in wanted):
            return None
        logprobs = logits.log_softmax(dim=-1)
        top = logprobs.topk(max(n or 0 for n in wanted) or 1, dim=-1)
        rows = []
        for row, n in enumerate(wanted):
            if n is None:
                rows.append(None)
                continue
            ids = top.indices[row, :n].tolist() + [tokens[row]]
            rows.append({i: logprobs[row, i].item() for i in ids})
        return rows
