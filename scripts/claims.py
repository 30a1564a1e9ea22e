"""claims.md: the paper's Countdown claims (§5.2-5.3, the numbers its text states) beside a
reproduction's, each with a goal, at the paper's budget: ε* (the rate whose peak-KV reduction is
2.4x on the no-evict model's completions) and, for the claims about stricter budgets, the testable
rates stricter than training's. `studies` maps a study's key (reproduce.studies_of) to its rows
over seeds, each with its per-seed, per-problem rewards; each claim is a tuple (claim, paper, goal,
here, met), met None where it was not measured and UNTESTABLE where no rate it needs is testable.

One denominator: every share is of the no-evict model's full cache on the same problems and prompt
layout. Every share and difference has a 95% interval from a paired bootstrap (`interval`). Beside
NGC stand the lookahead oracle (a heuristic that sees the future) and the hindsight bound with its
luck control (an estimate from above, by hindsight, of what eviction schedules exist at the
budget: baselines.py); a rate is testable by the bound."""
import numpy as np

from lib import baselines

# they know nothing of the task
AGNOSTIC = [name for name, p in baselines.POLICIES.items() if p.kind == "agnostic"]
# simple rules that could beat NGC
RULES = [name for name, p in baselines.POLICIES.items() if p.kind == "rule"]
BASELINES = AGNOSTIC + RULES
TAG_CHECK = 0.75  # the tag check's ε: the strictest tag trained on
TESTABLE = 0.2  # a rate is testable where the hindsight bound on NGC's model solves at least this
UNTESTABLE = "untestable"
UNTESTABLE_NOTE = f"untestable (the hindsight bound solves < {TESTABLE:.0%})"
BOOTSTRAP_DRAWS = 2000


def testable(bound) -> bool:
    """Whether the bound's row (on NGC's model, at one ε) shows that a cache of that size can hold
    the facts."""
    return bound["accuracy"] >= TESTABLE


def cell(r) -> str:
    """pass@1 as mean ± standard deviation across seeds (one seed: no ±)."""
    return f"{r['accuracy']:.1%}" + (f" ± {100 * r['accuracy_sd']:.1f}" if r["seeds"] > 1 else "")


def at(studies, study, policy, rate):
    return next(r for r in studies[study] if r["policy"] == policy and r["eviction_rate"] == rate)


def best_of(rows, policies):
    return max((r for r in rows if r["policy"] in policies), key=lambda r: r["accuracy"])


def ratio(a, b) -> float:
    return a["accuracy"] / max(b["accuracy"], 1e-9)


def times(a, b) -> str:
    """a's pass@1 as a multiple of b's, which may be 0."""
    return f"{ratio(a, b):.1f}×" if b["accuracy"] > 0 else "∞× (it solves none)"


def per_problem(row, seeds: int):
    """(seeds, problems) pass@1 of each problem at each seed; a row of one seed (the untrained
    model's) stands for every seed."""
    rewards = np.asarray(row["rewards"], dtype=float).mean(-1)  # (row's seeds, problems)
    if len(rewards) not in (1, seeds):
        raise ValueError(f"{row['run']} {row['policy']}: {len(rewards)} seeds "
                         f"where the others have {seeds}")
    return np.broadcast_to(rewards, (seeds, rewards.shape[1]))


def interval(stat, *rows, draws=BOOTSTRAP_DRAWS, seed=0) -> tuple[float, float]:
    """The 95% percentile interval of stat(pass@1 of each row) under a paired bootstrap: each draw
    resamples the seeds and the problems with replacement, one draw shared by every row, so that
    what the rows share (a problem's difficulty, a seed's problems) cancels in a share or a
    difference."""
    seeds = max(len(r["rewards"]) for r in rows)
    arrays = [per_problem(r, seeds) for r in rows]  # each (seeds, problems)
    if len({a.shape for a in arrays}) > 1:
        raise ValueError("rows on different problems cannot be paired")
    rng = np.random.default_rng(seed)
    s = rng.integers(seeds, size=(draws, seeds, 1))
    p = rng.integers(arrays[0].shape[1], size=(draws, 1, arrays[0].shape[1]))
    values = stat(*(a[s, p].mean((1, 2)) for a in arrays))  # (draws,)
    return tuple(np.percentile(values, [2.5, 97.5]).tolist())


def share(a, b) -> str:
    """a's pass@1 as a share of b's, with its 95% interval."""
    lo, hi = interval(lambda x, y: x / np.maximum(y, 1e-9), a, b)
    return f"{ratio(a, b):.0%} [{lo:.0%}, {hi:.0%}]"


def difference(a, b) -> tuple[float, float, float]:
    """a's pass@1 minus b's in points, with the bounds of its 95% interval."""
    lo, hi = interval(lambda x, y: x - y, a, b)
    return 100 * (a["accuracy"] - b["accuracy"]), 100 * lo, 100 * hi


def points(a, b) -> str:
    d, lo, hi = difference(a, b)
    return f"{d:+.1f} points [{lo:+.1f}, {hi:+.1f}]"


def beyond(a, b, by=0.0) -> bool:
    """Whether a's pass@1 is above b's by more than `by` and its 95% interval lies above 0."""
    d, lo, _ = difference(a, b)
    return d >= 100 * by and lo > 0


def stricter_testable(studies, trained):
    """The curve's rates stricter than training's final ε, each testable or not (the bound on NGC's
    model). A stricter rate must evict more: on a small cache two rates can keep the same whole
    blocks (the same rollouts), so a rate whose bound reaches no larger peak-KV reduction than at
    the rates up to `trained` is no test."""
    bound = [r for r in studies["curve-bound"] if r["policy"] == "bound"]
    reached = max((r["kv_reduction"] for r in bound if r["eviction_rate"] <= trained + 1e-9),
                  default=0.0)
    return {r["eviction_rate"]: testable(r) for r in bound
            if r["eviction_rate"] > trained + 1e-9 and r["kv_reduction"] > 1.01 * reached}


def claims_markdown(studies, budget, trained, below=None, training_rates=None) -> str:
    """The paper's Countdown claims beside this run's, each with a goal: at ε* = budget (and at
    `below`, the rate just under it, where whole blocks make ε* a cliff), and at the testable rates
    stricter than `trained` (the ngc run's final ε); interoception beyond `training_rates` (the
    interoception run's)."""
    rates = stricter_testable(studies, trained)
    claims = [*reasoning_claims(studies, budget, below), *policy_claims(studies, budget),
              interoception_claim(studies, rates, max(training_rates or [trained]), budget),
              *generalisation_claims(studies, budget, rates)]
    met = {True: "yes", False: "**no**", None: "-", UNTESTABLE: UNTESTABLE_NOTE}
    return "\n".join(["| claim | paper (§5.2-5.3) | goal | here, pass@1 [95% interval] | met |",
                      "|---|---|---|---|---|"]
                     + [f"| {a} | {b} | {g} | {c} | {met[m]} |" for a, b, g, c, m in claims])


def reasoning_claims(studies, e, below):
    """The full cache before and after training; NGC at ε* = e (and `below`) as a share of the
    no-evict model's full cache, beside NGC's own full cache, the oracle, the hindsight bound and
    its luck control on both models."""
    before, trained = at(studies, "untrained", "none", 0.0), at(studies, "baselines", "none", 0.0)
    ngc, full = at(studies, "ngc", "ngc", e), at(studies, "ngc", "none", 0.0)
    of = lambda r: f"{cell(r)} ({share(r, trained)})"
    reduced = lambda r: f"{of(r)} at {r['kv_reduction']:.2f}×"
    on_both = "; ".join(f"{name} on {model} {reduced(at(studies, study, name, e))}"
                        for name in ("bound", "luck", "oracle")
                        for study, model in (("ngc", "NGC's model"),
                                             ("baselines", "the no-evict model")))
    lower = (f"; at ε = {below:g}: {of(at(studies, 'below', 'ngc', below))} at "
             f"{at(studies, 'below', 'ngc', below)['kv_reduction']:.2f}×"
             if below is not None else "")
    greedy = at(studies, "greedy", "ngc", e)
    greedy_full, greedy_bound = (at(studies, "greedy-no-evict", "none", 0.0),
                                 at(studies, "greedy-no-evict", "bound", e))
    return [("the model learns to reason", "R1 near 0 → trained",
             "full cache before training ≤ 75%; no-evict training adds ≥ 15 points",
             f"full cache before training {cell(before)}, after no-evict training {cell(trained)} "
             f"({points(trained, before)})",
             before["accuracy"] <= 0.75 and trained["accuracy"] - before["accuracy"] >= 0.15),
            ("NGC keeps the reasoning under a smaller peak cache", "49.6% at 2.4×",
             f"NGC at ε* = {e:g} ≥ 70% of the no-evict model's full cache",
             f"{of(ngc)} at {ngc['kv_reduction']:.2f}× of {cell(trained)}{lower}; "
             f"NGC's own full cache {of(full)}; {on_both}; greedy tokens: NGC {cell(greedy)} "
             f"({ratio(greedy, greedy_full):.0%} of the no-evict model's {cell(greedy_full)}), "
             f"the bound there {cell(greedy_bound)} "
             f"({ratio(greedy_bound, greedy_full):.0%})", ratio(ngc, trained) >= 0.7),
            ("training NGC keeps the full cache's reasoning", "(not stated)",
             "NGC's own full cache at least the starting model's",
             f"{cell(full)} against {cell(before)} before training ({points(full, before)})",
             full["accuracy"] >= before["accuracy"])]


def policy_claims(studies, e):
    """NGC at ε* = e against the best task-agnostic baseline and task rule on either model, and its
    ablations."""
    ngc = at(studies, "ngc", "ngc", e)
    models = {"no-evict": "the no-evict model", "ngc": "NGC's own model"}
    best = {run: best_of([r for r in studies[study] if r["eviction_rate"] == e], AGNOSTIC)
            for run, study in (("no-evict", "baselines"), ("ngc", "ngc"))}
    rule = {run: best_of([r for r in studies[study] if r["eviction_rate"] == e], RULES)
            for run, study in (("no-evict", "baselines"), ("ngc", "ngc"))}
    multiples = "; ".join(f"on {models[run]} {r['policy']} {cell(r)}: NGC {times(ngc, r)} it"
                          for run, r in best.items())
    margins = "; ".join(f"on {models[run]} {r['policy']} {cell(r)}: NGC {points(ngc, r)}"
                        for run, r in rule.items())
    return [("NGC beats every baseline", "more than doubles the next best (49.6% vs 21.2%)",
             "≥ 2× the best task-agnostic baseline (heuristics, random, random-prompt) "
             "on each model", multiples,
             all(ratio(ngc, r) >= 2 for r in best.values())),
            ("NGC beats a hand-written rule", "(no such baseline)",
             "above the best task rule (task-rule, number-rule) on each model beyond its interval",
             margins,
             all(beyond(ngc, r) for r in rule.values())), *ablation_claims(studies, ngc, e)]


def ablation_claims(studies, ngc, e):
    """Token-only and targeted dropout against NGC (Figure 5)."""
    claims = [("the token policy learns to write for eviction", "token-only 35.7% (NGC 49.6%)",
               "token-only below NGC and ≥ 3× targeted dropout"),
              ("off-policy training fails", "targeted dropout 2.5%",
               "targeted dropout far below token-only (≤ ⅓ of it)")]
    if "token-only" not in studies:
        return [(*claim, "not measured (--no-ablations)", None) for claim in claims]
    token, dropout = at(studies, "token-only", "ngc", e), at(studies, "targeted-dropout", "ngc", e)
    return [(*claims[0], f"token-only {cell(token)}: {share(token, ngc)} of NGC, "
             f"{times(token, dropout)} targeted dropout",
             token["accuracy"] < ngc["accuracy"] and ratio(token, dropout) >= 3),
            (*claims[1], f"targeted dropout {cell(dropout)} "
             f"({share(dropout, token)} of token-only)",
             ratio(dropout, token) <= 1 / 3)]


def untestable_note(rates) -> str:
    return ", ".join(f"ε = {e:g}" for e, ok in rates.items() if not ok) + f" {UNTESTABLE_NOTE}"


def paired(studies, e) -> tuple[str, bool]:
    """The tagged model at ε = e over its blind control and over plain NGC, problem by problem, and
    whether it is ≥ 5 points above both, each interval above 0."""
    tagged = at(studies, "interoception", "ngc", e)
    blind, plain = (at(studies, "interoception-blind", "ngc", e),
                    at(studies, "interoception-ngc", "ngc", e))
    over = [(who, cell(r), *difference(tagged, r)) for who, r in (("blind", blind), ("NGC", plain))]
    text = f"ε = {e:g}: {cell(tagged)}, " + ", ".join(
        f"over {who} {c} {d:+.1f} points [{lo:+.1f}, {hi:+.1f}]" for who, c, d, lo, hi in over)
    return text, all(d >= 5 and lo > 0 for _, _, d, lo, _ in over)


def interoception_claim(studies, rates, top, e):
    """The tagged model against its blind control and against plain NGC, paired problem by
    problem, at each testable rate beyond `top`, the strictest rate it trained on (where none is,
    at ε* = e, inside its range, for what it is worth); and the same model and ε under other
    tags."""
    claim = ("interoception helps beyond the training budgets",
             "an 8-13% boost at aggressive budgets",
             f"≥ +5 points over the blind control and over plain NGC, each interval above 0, "
             f"at a testable ε beyond training's (its rates reach {top:g})")
    if "interoception" not in studies:
        return *claim, "not measured (--no-interoception)", None
    outside = {s: ok for s, ok in rates.items() if s > top + 1e-9}
    if not any(outside.values()):
        why = untestable_note(outside) if outside else f"no curve rate beyond {top:g}"
        return *claim, f"{why}; inside the training range, {paired(studies, e)[0]}", UNTESTABLE
    tests, lifts = zip(*(paired(studies, s) for s, ok in outside.items() if ok))
    met = any(lifts)
    same = [at(studies, study, "ngc", TAG_CHECK)
            for study in ("interoception", "tag-0.25", "tag-blind")]
    reads = ", ".join(f"tag {tag} {cell(r)} (length {r['length']:.0f})"
                      for tag, r in zip([f"{TAG_CHECK:g}", "0.25", "-"], same))
    return *claim, (f"{'; '.join(tests)}; the same model at ε = {TAG_CHECK:g} "
                    f"under three tags: {reads}"), met


def generalisation_claims(studies, e, rates):
    """NGC's margin over the best baseline of the curve at each testable ε stricter than
    training's; NGC at ε* = e on prompt layouts never trained on (of the same length, so rounds
    fire at the same tokens), as a share of the no-evict model's full cache there, against the
    untrained model there."""
    rivals = [r for r in studies["curve-baselines"] if r["policy"] in BASELINES]
    margin = {s: at(studies, "curve", "ngc", s)["accuracy"] - max(r["accuracy"] for r in rivals
                                                                  if r["eviction_rate"] == s)
              for s, ok in rates.items() if ok}
    claim = ("NGC generalises to unseen rates", "pareto-dominates the baselines",
             "above every baseline at every testable ε stricter than training's")
    if margin:
        untested = f"; {untestable_note(rates)}" if not all(rates.values()) else ""
        here = ", ".join(f"ε = {s:g} {100 * m:+.1f} points" for s, m in margin.items())
        rates_claim = (*claim, f"NGC's margin over the best baseline: {here}{untested}",
                       all(m > 0 for m in margin.values()))
    else:
        rates_claim = (*claim, untestable_note(rates), UNTESTABLE)
    layout = ("what NGC keeps, not where it sits", "(R1's prompts vary)",
              f"on layouts never trained on, NGC at ε* = {e:g} keeps ≥ 70% of the no-evict "
              f"model's full cache there, above the untrained model's score there")
    if "shifted-ngc" not in studies:
        return [rates_claim, (*layout, "not measured (the model's prompt has one layout)", None)]
    reference = at(studies, "shifted-no-evict", "none", 0.0)
    s_ngc, s_own = at(studies, "shifted-ngc", "ngc", e), at(studies, "shifted-ngc", "none", 0.0)
    s_before, s_best = (at(studies, "shifted-untrained", "ngc", e),
                        best_of(studies["shifted-baselines"], BASELINES))
    s_oracle = at(studies, "shifted-ngc", "oracle", e)
    return [rates_claim, (
        *layout,
        f"NGC {cell(s_ngc)} ({share(s_ngc, reference)} of the no-evict model's {cell(reference)} "
        f"there; training layouts "
        f"{ratio(at(studies, 'ngc', 'ngc', e), at(studies, 'baselines', 'none', 0.0)):.0%}"
        f"); NGC's own full cache there {cell(s_own)} ({share(s_own, reference)}); "
        f"the oracle there {cell(s_oracle)} ({share(s_oracle, reference)}); "
        f"untrained {cell(s_before)}; best baseline there {s_best['policy']} {cell(s_best)}",
        ratio(s_ngc, reference) >= 0.7 and s_ngc["accuracy"] > s_before["accuracy"])]
