"""Clocks a test steps itself, given to the code under test instead of the wall clock."""


class SteppedClock:
    """A source's clock that moves only when the source sleeps on it or the test steps it: pacing, no waiting."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
