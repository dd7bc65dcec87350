"""Text in and out of a session without an adapter: a lone session and a pool's stream share it."""

import torch


class TextTurns:
    """Text in and out of a session, for what needs no adapter (tests, the demo): the same on a lone session and a
    pool's stream, as both take `append`, `append_question` and `generate`."""

    def append_text(self, text: str, **kwargs) -> torch.Tensor:
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        return self.append(ids.expand(self.batch, -1), **kwargs)

    def answer(self, text: str, max_new_tokens: int = 64, **kwargs) -> str:
        """Ask `text` as a question turn and return the decoded answer of the first batch row."""
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        self.append_question(ids.expand(self.batch, -1))
        ids = [int(t[0]) for t in self.generate(max_new_tokens, **kwargs)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)
