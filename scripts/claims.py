"""claims.md: the paper's Countdown claims (§5.2-5.3) beside a reproduction's, each with a goal, at
ε* and at the testable rates stricter than training's. `studies` maps a study's name
(reproduce.studies_of) to its rows over seeds, with their per-seed, per-problem rewards.

Every share is of the no-evict model's full cache on the same problems and prompt layout, with a
95% interval from a paired bootstrap (`interval`). A rate is testable where the hindsight bound
(baselines.py) on NGC's model solves at least TESTABLE."""
import numpy as np

from evaluation import baselines

# they know nothing of the task
AGNOSTIC = [name for name, p in baselines.POLICIES.items() if p.kind == "agnostic"]
# simple rules that could beat NGC
RULES = [name for name, p in baselines.POLICIES.items() if p.kind == "rule"]
BASELINES = AGNOSTIC + RULES
TAG_CHECK = 0.75  # the tag check's ε: the strictest of the default training rates (and tiny/'s)
TESTABLE = 0.2
UNTESTABLE = "untestable"
MET = {True: "yes", False: "**no**", None: "-",
       UNTESTABLE: f"untestable (the hindsight bound solves < {TESTABLE:.0%})"}
BOOTSTRAP_DRAWS = 2000
# (claim, the paper's number, the goal here): {e} is ε*, {top} the interoception run's strictest ε
CLAIMS = [
    ("the model learns to reason", "R1 near 0 → trained",
     "full cache before training ≤ 75%; no-evict training adds ≥ 15 points"),
    ("NGC keeps the reasoning under a smaller peak cache",
     "49.6% at 2.4× (no full-cache accuracy stated, so no share)",
     "NGC at ε* = {e:g} ≥ 70% of the no-evict model's full cache"),
    ("training NGC keeps the full cache's reasoning", "(not stated)",
     "NGC's own full cache at least the starting model's"),
    ("NGC beats every baseline", "more than doubles the next best (49.6% vs 21.2%)",
     "≥ 2× the best task-agnostic baseline (heuristics, random, random-prompt) on each model"),
    ("NGC beats a hand-written rule", "(no such baseline)",
     "above the best task rule (task-rule, number-rule) on each model beyond its interval"),
    ("the token policy learns to write for eviction", "token-only 35.7% (NGC 49.6%)",
     "token-only below NGC and ≥ 3× targeted dropout"),
    ("off-policy training fails", "targeted dropout 2.5%",
     "targeted dropout far below token-only (≤ ⅓ of it)"),
    ("interoception helps beyond the training budgets", "an 8-13% boost at aggressive budgets",
     "≥ +5 points over the blind control and over plain NGC, each interval above 0, at a testable "
     "ε beyond training's (its rates reach {top:g})"),
    ("NGC generalises to unseen rates", "pareto-dominates the baselines",
     "above every baseline at every testable ε stricter than training's"),
    ("what NGC keeps, not where it sits", "(R1's prompts vary)",
     "on layouts never trained on, NGC at ε* = {e:g} keeps ≥ 70% of the no-evict model's full "
     "cache there, above the untrained model's score there")]


def table(head, rows) -> str:
    """A markdown table; an empty cell is `| |`."""
    line = lambda cells: "|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|"
    return "\n".join([line(head), "|" + "---|" * len(head), *map(line, rows)])


def testable(bound) -> bool:
    return bound["accuracy"] >= TESTABLE


def cell(r) -> str:
    """pass@1 as mean ± standard deviation across seeds (one seed: no ±)."""
    return f"{r['accuracy']:.1%}" + (f" ± {100 * r['accuracy_sd']:.1f}" if r["seeds"] > 1 else "")


def at(studies, study, policy, rate):
    return next(r for r in studies[study] if r["policy"] == policy and r["eviction_rate"] == rate)


def best_of(rows, policies):
    return max((r for r in rows if r["policy"] in policies), key=lambda r: r["accuracy"])


def ratio(row, base) -> float:
    return row["accuracy"] / max(base["accuracy"], 1e-9)


def times(row, base) -> str:
    return f"{ratio(row, base):.1f}×" if base["accuracy"] > 0 else "∞× (it solves none)"


def per_problem(row, seeds: int):
    """(seeds, problems) pass@1; a row of one seed (the untrained model's) stands for every seed."""
    rewards = np.asarray(row["rewards"], dtype=float).mean(-1)  # (row's seeds, problems)
    if len(rewards) not in (1, seeds):
        raise ValueError(f"{row['run']} {row['policy']}: {len(rewards)} seeds "
                         f"where the others have {seeds}")
    return np.broadcast_to(rewards, (seeds, rewards.shape[1]))


def interval(stat, *rows, draws=BOOTSTRAP_DRAWS, seed=0) -> tuple[float, float]:
    """The 95% percentile interval of stat(pass@1 of each row) under a paired bootstrap: one draw of
    seeds and problems shared by every row, so that what the rows share cancels in a share or a
    difference."""
    seeds = max(len(r["rewards"]) for r in rows)
    arrays = [per_problem(r, seeds) for r in rows]  # each (seeds, problems)
    if len({a.shape for a in arrays}) > 1:
        raise ValueError("rows on different problems cannot be paired")
    rng = np.random.default_rng(seed)
    seed_draws = rng.integers(seeds, size=(draws, seeds, 1))
    problem_draws = rng.integers(arrays[0].shape[1], size=(draws, 1, arrays[0].shape[1]))
    values = stat(*(a[seed_draws, problem_draws].mean((1, 2)) for a in arrays))  # (draws,)
    return tuple(np.percentile(values, [2.5, 97.5]).tolist())


def share(row, base) -> str:
    lo, hi = interval(lambda x, y: x / np.maximum(y, 1e-9), row, base)
    return f"{ratio(row, base):.0%} [{lo:.0%}, {hi:.0%}]"


def difference(row, base) -> tuple[float, float, float]:
    """row's pass@1 minus base's in points, with the bounds of its 95% interval."""
    lo, hi = interval(lambda x, y: x - y, row, base)
    return 100 * (row["accuracy"] - base["accuracy"]), 100 * lo, 100 * hi


def points(row, base) -> str:
    return "{:+.1f} points [{:+.1f}, {:+.1f}]".format(*difference(row, base))


def beyond(row, base, margin=0.0) -> bool:
    above, lo, _ = difference(row, base)
    return above >= margin and lo > 0


def stricter_testable(studies, trained):
    """{ε: testable} of the curve's rates stricter than `trained`. On a small cache two rates can
    keep the same whole blocks, so a rate whose bound reaches no larger peak-KV reduction than at
    the rates up to `trained` is no test."""
    bound = [r for r in studies["curve-bound"] if r["policy"] == "bound"]
    reached = max((r["kv_reduction"] for r in bound if r["eviction_rate"] <= trained + 1e-9),
                  default=0.0)
    return {r["eviction_rate"]: testable(r) for r in bound
            if r["eviction_rate"] > trained + 1e-9 and r["kv_reduction"] > 1.01 * reached}


def claims_markdown(studies, budget, trained, below=None, training_rates=None) -> str:
    """CLAIMS, each measured as (here, met) at ε* = budget (and `below`: whole blocks make ε* a
    cliff) and at the testable rates stricter than `trained` (the ngc run's final ε), beyond
    `training_rates`; met is None where not measured, UNTESTABLE where no rate it needs is."""
    rates, top = stricter_testable(studies, trained), max(training_rates or [trained])
    ngc = at(studies, "baselines-ngc", "ngc", budget)
    reference = at(studies, "baselines", "none", 0.0)  # the no-evict model's full cache
    measured = [*reasoning_claims(studies, budget, below, ngc, reference),
                *policy_claims(studies, budget, ngc), *ablation_claims(studies, budget, ngc),
                interoception_claim(studies, rates, top, budget), rates_claim(studies, rates),
                layout_claim(studies, budget, ratio(ngc, reference))]
    return table(["claim", "paper (§5.2-5.3)", "goal", "here, pass@1 [95% interval]", "met"],
                 [(claim, paper, goal.format(e=budget, top=top), here, MET[met])
                  for (claim, paper, goal), (here, met) in zip(CLAIMS, measured, strict=True)])


def reasoning_claims(studies, budget, below, ngc, trained):
    before, full = at(studies, "untrained", "none", 0.0), at(studies, "baselines-ngc", "none", 0.0)
    reduced = lambda r: f"{cell(r)} ({share(r, trained)}) at {r['kv_reduction']:.2f}×"
    on_both = "; ".join(f"{name} on {model} {reduced(at(studies, study, name, budget))}"
                        for name in ("bound", "luck", "oracle")
                        for study, model in (("baselines-ngc", "NGC's model"),
                                             ("baselines", "the no-evict model")))
    lower = (f"; at ε = {below:g}: {reduced(at(studies, 'below', 'ngc', below))}"
             if below is not None else "")
    greedy = at(studies, "greedy", "ngc", budget)
    greedy_full, greedy_bound = (at(studies, "greedy-no-evict", policy, rate)
                                 for policy, rate in (("none", 0.0), ("bound", budget)))
    return [(f"full cache before training {cell(before)}, after no-evict training {cell(trained)} "
             f"({points(trained, before)})",
             before["accuracy"] <= 0.75 and trained["accuracy"] - before["accuracy"] >= 0.15),
            (f"{reduced(ngc)} of {cell(trained)}{lower}; NGC's own full cache {cell(full)} "
             f"({points(full, trained)} against the no-evict model's); "
             f"{on_both}; greedy tokens: NGC {cell(greedy)} ({ratio(greedy, greedy_full):.0%} of "
             f"the no-evict model's {cell(greedy_full)}), the bound there {cell(greedy_bound)} "
             f"({ratio(greedy_bound, greedy_full):.0%})", ratio(ngc, trained) >= 0.7),
            (f"{cell(full)} against {cell(before)} before training ({points(full, before)})",
             full["accuracy"] >= before["accuracy"])]


def policy_claims(studies, budget, ngc):
    """NGC against the best task-agnostic baseline and task rule on either model."""
    on = (("the no-evict model", "baselines"), ("NGC's own model", "baselines-ngc"))
    best = lambda kind: {model: best_of([r for r in studies[study] if r["eviction_rate"] == budget],
                                        kind) for model, study in on}
    agnostic, rules = best(AGNOSTIC), best(RULES)
    return [("; ".join(f"on {model} {r['policy']} {cell(r)}: NGC {times(ngc, r)} it"
                       for model, r in agnostic.items()),
             all(ratio(ngc, r) >= 2 for r in agnostic.values())),
            ("; ".join(f"on {model} {r['policy']} {cell(r)}: NGC {points(ngc, r)}"
                       for model, r in rules.items()),
             all(beyond(ngc, r) for r in rules.values()))]


def ablation_claims(studies, budget, ngc):
    if "ablation-token-only" not in studies:
        return [("not measured (--no-ablations)", None)] * 2
    token, dropout = (at(studies, f"ablation-{run}", "ngc", budget)
                      for run in ("token-only", "targeted-dropout"))
    return [(f"token-only {cell(token)}: {share(token, ngc)} of NGC, {times(token, dropout)} "
             "targeted dropout",
             token["accuracy"] < ngc["accuracy"] and ratio(token, dropout) >= 3),
            (f"targeted dropout {cell(dropout)} ({share(dropout, token)} of token-only)",
             ratio(dropout, token) <= 1 / 3)]


def untestable_note(rates) -> str:
    return ", ".join(f"ε = {e:g}" for e, ok in rates.items() if not ok) + f" {MET[UNTESTABLE]}"


def paired(studies, rate) -> tuple[str, bool]:
    """The tagged model at ε = rate over its blind control and plain NGC, and whether it is ≥ 5
    points above both, each interval above 0."""
    tagged, *others = (at(studies, study, "ngc", rate) for study in
                       ("interoception", "interoception-blind", "interoception-ngc"))
    over = list(zip(("blind", "NGC"), others))
    return (f"ε = {rate:g}: {cell(tagged)}, "
            + ", ".join(f"over {who} {cell(r)} {points(tagged, r)}" for who, r in over),
            all(beyond(tagged, r, 5) for _, r in over))


def interoception_claim(studies, rates, top, budget):
    """paired() at each testable rate beyond `top` (where none is, at ε* = budget, inside its range,
    for what it is worth); the same model and ε under other tags."""
    if "interoception" not in studies:
        return "not measured (--no-interoception)", None
    outside = {s: ok for s, ok in rates.items() if s > top + 1e-9}
    if not any(outside.values()):
        why = untestable_note(outside) if outside else f"no curve rate beyond {top:g}"
        return f"{why}; inside the training range, {paired(studies, budget)[0]}", UNTESTABLE
    tests, lifts = zip(*(paired(studies, s) for s, ok in outside.items() if ok))
    same = [at(studies, study, "ngc", TAG_CHECK)
            for study in ("interoception", "tag-0.25", "tag-blind")]
    reads = ", ".join(f"tag {tag} {cell(r)} (length {r['length']:.0f})"
                      for tag, r in zip([f"{TAG_CHECK:g}", "0.25", "-"], same))
    return (f"{'; '.join(tests)}; the same model at ε = {TAG_CHECK:g} under three tags: {reads}",
            any(lifts))


def rates_claim(studies, rates):
    """NGC's margin over the curve's best baseline at each testable ε stricter than training's."""
    rivals = [r for r in studies["curve-baselines"] if r["policy"] in BASELINES]
    margin = {s: at(studies, "curve", "ngc", s)["accuracy"] - max(r["accuracy"] for r in rivals
                                                                  if r["eviction_rate"] == s)
              for s, ok in rates.items() if ok}
    if not margin:
        return untestable_note(rates), UNTESTABLE
    untested = f"; {untestable_note(rates)}" if not all(rates.values()) else ""
    here = ", ".join(f"ε = {s:g} {100 * m:+.1f} points" for s, m in margin.items())
    return (f"NGC's margin over the best baseline: {here}{untested}",
            all(m > 0 for m in margin.values()))


def layout_claim(studies, budget, trained):
    """NGC on prompt layouts never trained on (as long, so rounds fire at the same tokens) against
    the untrained model there; `trained`: its share on the training layouts."""
    if "shifted-ngc" not in studies:
        return "not measured (the model's prompt has one layout)", None
    reference = at(studies, "shifted-no-evict", "none", 0.0)
    ngc, own, oracle = (at(studies, "shifted-ngc", policy, rate)
                        for policy, rate in (("ngc", budget), ("none", 0.0), ("oracle", budget)))
    before = at(studies, "shifted-untrained", "ngc", budget)
    best = best_of(studies["shifted-baselines"], BASELINES)
    return (f"NGC {cell(ngc)} ({share(ngc, reference)} of the no-evict model's {cell(reference)} "
            f"there; training layouts {trained:.0%}); NGC's own full cache there {cell(own)} "
            f"({points(own, reference)}); the oracle there {cell(oracle)} "
            f"({share(oracle, reference)}); untrained {cell(before)}; best baseline there "
            f"{best['policy']} {cell(best)}",
            ratio(ngc, reference) >= 0.7 and ngc["accuracy"] > before["accuracy"])
