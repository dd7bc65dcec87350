"""stream_ppl compares each later pass over the repeated corpus with the first pass over the same text."""

import pytest

from benchmarks.stream_ppl import by_pass


def records(period, segment, n, ppl):
    return [{"x": x, "value": ppl(x)} for x in range(segment, n * segment + 1, segment)]


@pytest.mark.parametrize("period", [4096, 4096 + 27])  # the corpus length need not be a multiple of a segment
def test_a_stream_that_depends_only_on_the_text_gives_equal_passes(period):
    text_ppl = lambda x: 50 + ((x - 1) % period) // 1024  # noqa: E731
    out = by_pass(records(period, 1024, 11, text_ppl), period, 1024)
    assert [p for p, *_ in out] == [2, 3]
    for _, later, first, previous in out:
        assert later == pytest.approx(first) == pytest.approx(previous)


def test_a_degrading_stream_shows_in_the_later_pass():
    period = 4096
    ppl = lambda x: (50 + ((x - 1) % period) // 1024) * (1.1 if x > period else 1.0)  # noqa: E731
    (p, later, first, previous), = by_pass(records(period, 1024, 8, ppl), period, 1024)
    assert p == 2 and later == pytest.approx(1.1 * first) and previous == first
