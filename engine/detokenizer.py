"""Incremental detokenization with stop strings.

Each new token is decoded together with the token before it (for context-dependent spacing)
and the text they add is the difference of two decodes. The window then slides forward even
when the new token decodes to "" (a special or byte-fallback token), so the work per token stays
flat: a detokenizer that only slides on non-empty text re-decodes an ever-growing window and
slows a stream down as it gets longer (case C03). Text ending in U+FFFD is an incomplete UTF-8
character split across tokens; it is held back for at most :data:`MAX_HELD_TOKENS` tokens.

Stop strings may span tokens: the text is searched across the boundary and truncated at the
match. While streaming, only the tail of the text that is still a prefix of some stop string is
withheld (``"...EN"`` with stop ``"END"``); the moment it can no longer start a match it is
released. A stop string that never begins to appear withholds nothing, however long it is.
"""

from __future__ import annotations

MAX_HELD_TOKENS = 6  # a UTF-8 character is at most 4 bytes, i.e. 4 byte-fallback tokens
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...) -> str`` (a Hugging
            Face tokenizer or ``tokenizers.Tokenizer``).
        prompt_token_ids: the prompt; its last tokens give the first output token context.
        skip_special_tokens: leave special tokens out of the text.
        stop: stop strings.
    """

    def __init__(
        self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True, stop=()
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        # the most characters a match can reach back into text already searched
        self._reach = max((len(s) for s in self.stop), default=1) - 1
        tail = list(prompt_token_ids[-4:])
        self._ids = tail
        self._prefix = 0
        self._read = len(tail)
        self.text = ""
        self._emitted = 0
        self.decoded_tokens = 0  # tokens passed to decode(), for the flat-cost check

    def _decode(self, ids: list[int]) -> str:
        self.decoded_tokens += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Consume one token. Returns the stop string it completed, if any (text is then
        truncated before the stop string)."""
        self._ids.append(token_id)
        window = self._ids[self._prefix :]
        full = self._decode(window)
        if full.endswith(REPLACEMENT) and len(self._ids) - self._read < MAX_HELD_TOKENS:
            return None  # an incomplete character: wait for its next byte
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = full[len(prefix_text) :] if full.startswith(prefix_text) else full
        self._prefix, self._read = self._read, len(self._ids)
        if len(self._ids) > 64:  # keep the list short; offsets move with it
            drop = self._prefix
            self._ids = self._ids[drop:]
            self._prefix -= drop
            self._read -= drop
        if not new_text:
            return None
        search_from = max(0, len(self.text) - self._reach)
        self.text += new_text
        matches = [
            (idx, stop) for stop in self.stop if (idx := self.text.find(stop, search_from)) != -1
        ]
        if not matches:
            return None
        idx, stop = min(matches)
        self.text = self.text[:idx]
        return stop

    def held_chars(self) -> int:
        """Characters at the end of :attr:`text` that are withheld from streaming now: the
        longest tail (not yet returned) that is a prefix of some stop string; 0 without one."""
        text, n, longest = self.text, len(self.text), 0
        for stop in self.stop:
            # candidate starts: where the stop's first character occurs in the unreturned tail
            pos = text.find(stop[0], max(self._emitted, n - len(stop) + 1), n - longest)
            while pos != -1:
                if stop.startswith(text[pos:]):
                    longest = n - pos
                    break
                pos = text.find(stop[0], pos + 1, n - longest)
        return longest

    def take_delta(self, finished: bool = False) -> str:
        """Text not yet returned. While unfinished, a tail that may still become a stop string
        (:meth:`held_chars`) is kept back; everything before it is returned."""
        end = len(self.text) if finished else len(self.text) - self.held_chars()
        end = max(self._emitted, end)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
