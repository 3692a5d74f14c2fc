"""llmd.policy.draws makes the stdlib's draws: the same generator state gives the same picks."""

from __future__ import annotations

import random

import pytest

from llmd.policy import draws


@pytest.mark.parametrize("n", [1, 2, 3, 7, 21, 22, 80, 1000])
def test_choice_is_the_stdlibs_choice(n: int) -> None:
    ours, theirs = random.Random(n), random.Random(n)
    seq = list(range(n))
    assert [draws.choice(ours, seq) for _ in range(500)] == [theirs.choice(seq) for _ in range(500)]
    assert ours.random() == theirs.random()  # and the generator is left where the stdlib leaves it


@pytest.mark.parametrize(("n", "k"), [(1, 1), (4, 4), (5, 3), (21, 4), (22, 4), (80, 4), (80, 0), (80, 6),
                                      (120, 30), (400, 30), (3, 0)])
def test_sample_is_the_stdlibs_sample_on_both_of_its_paths(n: int, k: int) -> None:
    ours, theirs = random.Random(n * 1000 + k), random.Random(n * 1000 + k)
    pop = [f"r{i}" for i in range(n)]
    for _ in range(200):
        assert draws.sample(ours, pop, k) == theirs.sample(pop, k)
    assert ours.random() == theirs.random()


def test_bad_draws_raise_as_the_stdlibs_do() -> None:
    rng = random.Random(0)
    with pytest.raises(IndexError):
        draws.choice(rng, [])
    with pytest.raises(ValueError, match="Sample larger"):
        draws.sample(rng, [1, 2], 3)
    with pytest.raises(ValueError, match="Sample larger"):
        draws.sample(rng, [1, 2], -1)
