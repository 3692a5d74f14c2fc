"""`random.Random.choice` and `.sample`, the same draws from the same generator, as typed code.

Why: the simulator routes every arrival by sampling a few replicas and picking among the
near-best, and the stdlib's two methods are Python, not C; compiled with the policies
(llmd/plan/compiled.py) these run at C speed, where the stdlib's were about a twentieth of a
seed-scale run. They consume `getrandbits` exactly as CPython 3.11-3.13's methods do, so a seed
gives the same picks (and the same report) compiled, as Python, or with the stdlib's methods;
tests/unit/test_draws.py checks that against the stdlib.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def below(rng: random.Random, n: int) -> int:
    """A uniform int in [0, n): `Random._randbelow_with_getrandbits` (rejection on n's bit length)."""
    k = n.bit_length()
    r = rng.getrandbits(k)
    while r >= n:
        r = rng.getrandbits(k)
    return r


def choice(rng: random.Random, seq: Sequence[T]) -> T:
    """`rng.choice(seq)`."""
    if not seq:
        raise IndexError("Cannot choose from an empty sequence")
    return seq[below(rng, len(seq))]


def sample(rng: random.Random, population: Sequence[T], k: int) -> list[T]:
    """`rng.sample(population, k)`: a short population is drawn from a shrinking pool, a long
    one by rejecting repeats, on the stdlib's threshold between the two."""
    n = len(population)
    if not 0 <= k <= n:
        raise ValueError("Sample larger than population or is negative")
    setsize = 21  # the stdlib's: a small set's size less an empty list's
    if k > 5:
        setsize += 4 ** math.ceil(math.log(k * 3, 4))
    result: list[T] = []
    if n <= setsize:
        pool = list(population)
        for i in range(k):
            j = below(rng, n - i)
            result.append(pool[j])
            pool[j] = pool[n - i - 1]
        return result
    selected: set[int] = set()
    for _ in range(k):
        j = below(rng, n)
        while j in selected:
            j = below(rng, n)
        selected.add(j)
        result.append(population[j])
    return result
