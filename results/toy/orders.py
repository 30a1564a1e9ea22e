"""How much of a held-out set a search fits in a completion cap, by the order it tries moves in.

For the tiny problems that go back (tiny-back) and those that leave the first pair (tiny-deep): the
share whose depth-first trace (countdown.trace's format, its tokens by tiny/'s tokenizer) fits in 64,
80, 96 and 128 tokens, in the canonical order, in a random one (the mean of 20 draws of trace's
shuffle), and in the worst and best of the 144 fixed orders of the pairs and the first move's
operations. Writes orders.txt beside it: python results/toy/orders.py
"""
import itertools
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from tokenizers import Tokenizer  # noqa: E402

import countdown as cd  # noqa: E402

CAPS = (64, 80, 96, 128)
PAIRS = [(0, 1), (0, 2), (1, 2)]  # of the numbers sorted down
tokenizer = Tokenizer.from_file(os.path.join(HERE, "..", "..", "tiny", "tokenizer.json"))


def n_tokens(text):
    return len(tokenizer.encode(text).ids)


class FixedOrder:
    """Stands in for trace's rng with shuffle=1: every shuffle it asks for returns `pairs`' order of the pairs
    and `ops`' order of a first move's operations, so countdown.trace writes that fixed order's search."""
    def __init__(self, pairs, ops):
        self.pairs, self.ops = list(pairs), ops

    def random(self):
        return 0.0  # below shuffle = 1: the order is drawn, i.e. fixed here

    def sample(self, xs, k):
        key = self.pairs.index if xs[0] in self.pairs else (lambda move: self.ops.index(move[0]))
        return sorted(xs, key=key)


def fixed_order_trace(p, pairs, ops):
    return cd.trace(p, rng=FixedOrder(pairs, ops), shuffle=1.0)


def fits(lengths):  # the share within each cap
    return [sum(n <= cap for n in lengths) / len(lengths) for cap in CAPS]


def row(name, shares):
    return f"{name:<46}" + "".join(f"{100 * s:>7.1f}" for s in shares)


def table(name, problems):
    canonical = [n_tokens(cd.trace(p)) for p in problems]
    assert canonical == [n_tokens(fixed_order_trace(p, PAIRS, "+*-/")) for p in problems]
    rng = random.Random(0)
    draws = [fits([n_tokens(cd.trace(p, rng=rng, shuffle=1.0)) for p in problems]) for _ in range(20)]
    fixed = {(pairs, "".join(ops)): fits([n_tokens(fixed_order_trace(p, pairs, ops)) for p in problems])
             for pairs in itertools.permutations(PAIRS) for ops in itertools.permutations("+*-/")}
    worst, best = (f(fixed, key=lambda k: fixed[k][CAPS.index(96)]) for f in (min, max))
    name_of = lambda k: "pairs " + " ".join(f"{i}{j}" for i, j in k[0]) + ", ops " + k[1]
    return "\n".join([f"{name}: {len(problems)} held-out problems; % whose search fits the cap",
                      f"{'order':<46}" + "".join(f"{cap:>7}" for cap in CAPS),
                      row("canonical (pairs 01 02 12, +*-/)", fits(canonical)),
                      row("random (mean of 20 draws)", [statistics.mean(d) for d in zip(*draws)]),
                      row("worst fixed at 96: " + name_of(worst), fixed[worst]),
                      row("best fixed at 96: " + name_of(best), fixed[best])])


if __name__ == "__main__":
    text = "\n\n".join(table(name, cd.held_out(cd.DIFFICULTIES[name])) for name in ("tiny-back", "tiny-deep"))
    with open(os.path.join(HERE, "orders.txt.tmp"), "w") as f:
        f.write(text + "\n")
    os.replace(os.path.join(HERE, "orders.txt.tmp"), os.path.join(HERE, "orders.txt"))
    print(text)
