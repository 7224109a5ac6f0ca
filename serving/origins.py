"""Where each streamed token came from: the per-token entries of `stream_options.include_origins` (`mirror_rt.tokens`).

Each entry: token id, the text it released, its origin (`Step.origin`: draft, correction, bonus, target, forced;
readers take unknown ones as plain), its window (decode step) and position. Held-back text is released by a later
token, so texts may be "" but always join to the chunk's content; text released by no token has token null.
"""

from __future__ import annotations


class OriginTrail:
    """The entries of one generation, piece by piece."""

    def __init__(self):
        self.sent = 0  # tokens described so far
        self.window = 0  # the step the next token belongs to
        self.start = 0  # index of that step's first token

    @staticmethod
    def committed(gen) -> list[int]:
        """The generation's tokens as usage counts them: its text's, then the end-of-sequence token if one ended it."""
        end = getattr(gen, "end_token", None)
        return gen.tokens if end is None else [*gen.tokens, end]

    def pending(self, gen) -> bool:
        """Whether tokens were committed since the last call."""
        return len(self.committed(gen)) > self.sent

    def entries(self, gen, piece: str) -> list[dict]:
        """Entries for the tokens pushed since the last call; the last of them carries `piece`."""
        out, tokens = [], self.committed(gen)
        for index in range(self.sent, len(tokens)):
            while index >= self.start + gen.steps[self.window].tokens:  # the token is in a later step
                self.start += gen.steps[self.window].tokens
                self.window += 1
            step, position = gen.steps[self.window], index - self.start
            out.append({"token": tokens[index], "text": "", "origin": step.origin(position),
                        "window": self.window, "position": position, "drafted": step.drafted})
            if index >= len(gen.tokens):  # the end-of-sequence token
                out[-1]["end"] = True
        self.sent = len(tokens)
        if not out:
            return [{"token": None, "text": piece, "origin": None, "window": None, "position": None,
                     "drafted": None}]
        out[-1]["text"] = piece
        return out
