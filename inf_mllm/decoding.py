"""What a decode loop does around each model step (session.py): pick the next token, and hand it to the consumer.
"""

import torch


class HandOver:
    """How each answer token reaches the consumer. From a GPU it goes through pinned host memory with the rows'
    end flags, and only that copy is waited for, so a step queued after it (run ahead) keeps the GPU busy; on a
    CPU the token is there already."""

    def __init__(self, device: torch.device, batch: int):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.empty((2, batch), dtype=torch.long, pin_memory=True)
            self.ready = torch.cuda.Event()

    def send(self, token: torch.Tensor, done: torch.Tensor) -> None:
        self.token, self.done = token, done
        if self.cuda:
            self.host[0].copy_(token, non_blocking=True)
            self.host[1].copy_(done, non_blocking=True)
            self.ready.record(torch.cuda.current_stream(self.device))  # the model's GPU, not the current one

    def receive(self) -> tuple[torch.Tensor, bool]:
        """The tokens (B,) on the CPU and whether every row has ended, once they are there."""
        if not self.cuda:
            return self.token, bool(self.done.all())
        self.ready.synchronize()
        return self.host[0].clone(), bool(self.host[1].all())


def eos_set(eos) -> set[int]:
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def pick(logits, do_sample, temperature, top_p, generator) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
