"""Stop strings, found as the output grows (docs/design.md §2, step 5; vLLM's `stop`).

A step may commit several tokens at once; generation ends at the first token whose text completes a stop string,
and the tokens after it are dropped. Each check decodes only a tail window of the output: the new tokens and
enough tokens before them to hold a stop string that ends in the new ones.
"""

from __future__ import annotations

from collections.abc import Callable

# tokens a window starts early beyond what a stop string can span: a tail decoded alone can differ from the same
# tokens decoded in context at its first characters (sentencepiece drops a leading space, a UTF-8 character split
# across byte tokens decodes to U+FFFD), and these keep such characters before any text a stop string reaches
BOUNDARY_TOKENS = 4


class StopStrings:
    """The stop strings of one request, over a decoder of token ids (LoadedModel.decode)."""

    def __init__(self, stops: list[str], decode: Callable[[list[int]], str]):
        self.stops = list(stops)
        self.decode = decode
        self.longest = max(len(s) for s in self.stops)
        # a token decodes to at least one byte (but for special tokens, skipped), so a stop string spans at most
        # its UTF-8 length in tokens
        self.span = max(len(s.encode()) for s in self.stops) + BOUNDARY_TOKENS

    def first(self, text: str, after: int = 0) -> tuple[int, int] | None:
        """(start, end) in `text` of the stop string that ends first among those ending past character `after`;
        of several ending there, the one that starts first (so the text before it holds no stop string)."""
        best = None
        for stop in self.stops:
            start = text.find(stop, max(0, after - len(stop) + 1))  # the first occurrence ends first
            if start >= 0 and (best is None or (start + len(stop), start) < (best[1], best[0])):
                best = (start, start + len(stop))
        return best

    def completed(self, output: list[int], new: int) -> int | None:
        """Tokens of `output` to keep when a token at index `new` or later completes a stop string: up to and
        including the first such token. None when none does (the text before `new` was checked before)."""
        span = self.span
        while True:  # widen the window while special tokens (no text) leave too little before the new tokens
            window = max(0, new - span)
            before = self.decode(output[window:new])
            if window == 0 or len(before) >= self.longest + BOUNDARY_TOKENS:
                break
            span *= 2
        text = self.decode(output[window:])
        # where the new text starts: the first character the new tokens changed (usually len(before); earlier
        # when they complete a character that `before` ended with a part of)
        seen = next((i for i, (a, b) in enumerate(zip(before, text)) if a != b), min(len(before), len(text)))
        if self.first(text, seen) is None:
            return None
        for end in range(new + 1, len(output)):  # the first new token whose text completes one
            if self.first(self.decode(output[window:end]), seen) is not None:
                return end
        return len(output)

    def cut(self, text: str) -> str:
        """The output text before its first stop string."""
        found = self.first(text)
        return text if found is None else text[:found[0]]
