"""The output text of a sequence, grown one token at a time, and stop strings with vLLM's
semantics (see core/outputs.py)."""
from __future__ import annotations

from core.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """The output text of one sequence, grown one token at a time.

    Each token decodes a short window (the tokens since the last emitted text, plus the one
    before them for context) twice and appends the difference, so the cost per token does
    not grow with the output. Text whose last character is an incomplete UTF-8 sequence
    ("\\ufffd") waits for the next token. ``context_ids`` (e.g. the prompt's last tokens)
    seed the window, for tokenizers whose decoding of a token depends on what precedes it.
    """

    def __init__(self, tokenizer, params: SamplingParams, context_ids=()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or ())
        self.include_stop_str = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.token_ids = [int(t) for t in context_ids]
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)  # the context is read
        self.num_output_tokens = 0
        self.text = ""

    def update(self, token_id: int, stop_terminated: bool = False) -> str | None:
        """Add one generated token; returns the stop string it completed, if any.
        ``stop_terminated``: the token is EOS or a stop token id, whose text is left out
        unless ``include_stop_str_in_output``."""
        self.num_output_tokens += 1
        if stop_terminated and not self.include_stop_str:
            return None
        self.token_ids.append(int(token_id))
        new_chars = self._decode_new_text()
        if not new_chars or not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        return self._check_stop_strings(new_chars)

    def visible_text(self, finished: bool) -> str:
        """The text to show now: while unfinished, the last characters that could still turn
        out to begin a stop string are held back (they would be cut if it completes)."""
        if finished or self.include_stop_str or not self.stop:
            return self.text
        hold = max(len(s) for s in self.stop) - 1
        return self.text[:max(0, len(self.text) - hold)]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new_text(self) -> int:
        """Append the text the new token completes; returns how many characters were added."""
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        read = len(before)
        if not after.startswith(before):
            # The window ended inside a character ("\ufffd", e.g. a prompt cut mid-"€") that the
            # new token completes: the whole character is new text.
            read = len(before.rstrip("\ufffd"))
        if after.endswith("\ufffd") or len(after) <= read:
            return 0  # an incomplete character (or nothing visible yet): wait for more tokens
        self.text += after[read:]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return len(after) - len(before)

    def _check_stop_strings(self, new_chars: int) -> str | None:
        """Find the stop string that ends earliest in the new text and cut the text there."""
        best, best_start, best_end = None, 0, len(self.text) + 1
        for stop in self.stop:
            start = self.text.find(stop, max(0, len(self.text) - new_chars - len(stop) + 1))
            if start != -1 and start + len(stop) < best_end:
                best, best_start, best_end = stop, start, start + len(stop)
        if best is not None:
            self.text = self.text[:best_end if self.include_stop_str else best_start]
        return best
