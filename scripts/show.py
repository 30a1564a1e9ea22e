"""A picture of what the model forgets: every layer's KV cache over a greedy rollout, before and
after training.

    python scripts/show.py --model runs/ngc/checkpoint [--before tiny] [--problems 4] \\
        [--eviction-rate 0.5] --out forgets.html [--png forgets.png]

The run's first N held-out problems (as eval.py prompts them) are completed greedily by the
untrained model (--before) and by the checkpoint, under NGC's evaluation policy (greedy top-K
blocks on ψ at ε). The page (self-contained HTML) shows each problem's two rollouts side by side
as a grid, a row per layer and a cell per token, coloured by the round that evicted that token's
key at that layer (the paper's Figure 2, top, for every layer): round k fires once the sequence
holds kδ tokens, k = death // δ (replay.evicted_by).
"""
import html
import os
import sys

import torch

# the repository root first
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ngc import Eviction, rollout
from replay import death_times, evicted_by
from lib import distributed, settings
from lib.checkpoint import META_TOKEN, load, load_config
from lib.cli import (at_least, check_output_file, check_values, exits, need, one_line_errors,
                     parser, pyplot, writing)
from lib.files import save_figure, write_text
from lib.settings import run_defaults
from lib.tasks import TASK_REWARD, check_prompts, held_out, prompt_encoder

BEFORE = settings.EXAMPLE  # --before's default: the model shipped for the task
ALIVE = -1  # a key's fate when no round evicted it: still in the cache at the end
ALIVE_COLOUR = "#d9d9d9"
# the rounds, first (dark) to last (yellow)
VIRIDIS = ["#440154", "#3b528b", "#21918c", "#5ec962", "#fde725"]
CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:1.5em} h3{font-size:14px;margin:.4em 0}
.pair{display:flex;gap:2em;flex-wrap:wrap;margin-bottom:2em}
.run{flex:1 1 0;min-width:24em;overflow-x:auto} .correct{color:#1a7f37} .wrong{color:#c62828}
table{border-collapse:collapse} td{width:9px;height:10px;padding:0;border:1px solid #fff}
th{font:10px monospace;font-weight:normal;padding:0 1px 3px;vertical-align:bottom;white-space:pre}
thead th{writing-mode:vertical-rl} thead th.p{color:#888} th.l{text-align:right;padding-right:4px}
.s{border-left:2px solid #000}
.key{display:inline-block;width:1em;height:1em;vertical-align:middle;margin:0 .3em 0 .8em}"""


def fates(rolled, row: int, tokenizer):
    """Rollout row `row`'s token texts (prompt + completion) and death rounds (L, T): the 0-based
    round that evicted key s at layer l, ALIVE (-1) where none did."""
    one = rolled.select([row])
    length = int(one.lengths[0])
    texts = tokenizer.decode_batch([[t] for t in one.tokens[0, :length].tolist()],
                                   skip_special_tokens=False)
    if one.eviction is None:  # the full cache: nothing is ever evicted
        return texts, torch.full((one.kept.shape[2], length), ALIVE)
    # (L, T)
    death = death_times(one.kept, one.n_rounds, length, one.eviction.delta, one.eviction.block)[0]
    return texts, evicted_by(death, one.eviction.delta)


def rounds_run(runs: dict) -> int:
    """The most rounds any rollout ran: the colour scale's length."""
    return max(int(run["rounds"].max()) + 1 for rs in runs.values() for run in rs)


def round_colour(index: int, count: int) -> str:
    position = index / max(count - 1, 1) * (len(VIRIDIS) - 1)
    low = min(int(position), len(VIRIDIS) - 2)
    below, above = (bytes.fromhex(VIRIDIS[j][1:]) for j in (low, low + 1))
    return "#" + bytes(round(u + (position - low) * (v - u)) for u, v in zip(below, above)).hex()


def summary(run) -> str:
    """The completion's length, the fractions of prompt and completion keys never evicted."""
    alive = (run["rounds"] == ALIVE).float()  # (L, T)
    prompt_len = run["prompt_len"]
    return (f"{alive.shape[1] - prompt_len} new tokens, not evicted: prompt "
            f"{alive[:, :prompt_len].mean():.0%}, completion {alive[:, prompt_len:].mean():.0%}")


def trace_rollouts(model, tokenizer, cfg, problems, ev: Eviction):
    """Per problem, its greedy rollout under ev: verdict, token texts and death rounds."""
    meta = tokenizer.token_to_id(META_TOKEN) if cfg.meta_token else None
    encode = prompt_encoder(cfg.task, cfg.prompt, ev.rate if cfg.interoception else None,
                            cfg.blind_tag)
    sampling = settings.sampling(cfg, held_out=True, greedy=True, meta_token=meta)
    rolled = rollout(model, [encode(tokenizer, p) for p in problems], sampling, ev,
                     eos_ids=model.config.eos_ids)
    completions = tokenizer.decode_batch(rolled.completions(), skip_special_tokens=True)
    runs = []
    for row, (problem, text) in enumerate(zip(problems, completions)):
        tokens, rounds = fates(rolled, row, tokenizer)
        correct = TASK_REWARD[cfg.task](text, problem) == 1.0
        runs.append(dict(verdict="correct" if correct else "wrong", tokens=tokens, rounds=rounds,
                         prompt_len=int(rolled.prompt_lens[row])))
    return runs


def grid(run) -> str:
    prompt_len = run["prompt_len"]
    head = ["<th></th>"]
    for index, text in enumerate(run["tokens"]):
        cls = ' class="p"' if index < prompt_len else ' class="s"' if index == prompt_len else ""
        shown = html.escape(text.replace("\n", "⏎").replace("\t", "⇥"))
        head.append(f'<th{cls} title="token {index}">{shown}</th>')
    rows = []
    for layer, fate in enumerate(run["rounds"].tolist()):
        cells = "".join(f'<td class="{"alive" if r == ALIVE else f"r{r}"}'
                        f'{" s" if t == prompt_len else ""}"></td>' for t, r in enumerate(fate))
        rows.append(f'<tr><th class="l">layer {layer}</th>{cells}</tr>')
    return f"<table><thead><tr>{''.join(head)}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def render_html(problems, runs: dict, cfg, ev: Eviction, models: dict) -> str:
    """The page: settings and legend, then per problem the runs ({name: [run per problem]})."""
    count = rounds_run(runs)
    colours = "".join(f".r{r}{{background:{round_colour(r, count)}}}" for r in range(count))
    legend = '<span class="key alive"></span>not evicted (in the cache at the end)' + "".join(
        f'<span class="key r{r}"></span>round {r + 1}' for r in range(count))
    paths = ", ".join(f"{name}: <code>{html.escape(os.path.relpath(path))}</code>"
                      for name, path in models.items())
    intro = (f"<p>Each grid is one greedy rollout, a row per layer and a cell per token (the "
             f"prompt in grey, then the completion after the black line), coloured by the round "
             f"that evicted that token's key from that layer's cache (round k fires once the "
             f"sequence holds kδ tokens and keeps NGC's top K blocks), grey if none did. "
             f"ε = {ev.rate:g}, δ = {ev.delta}, b = {ev.block}, w = {ev.window}, at most "
             f"{cfg.eval_max_new_tokens or cfg.max_new_tokens} new tokens, task {cfg.task}; "
             f"{paths}.</p>")
    body = [f"<h1>What the model forgets</h1>{intro}<p>{legend}</p>"]
    for i, problem in enumerate(problems):
        body.append(f"<h2>problem {i + 1}: {html.escape(str(problem))}</h2><div class=\"pair\">")
        for name, rs in runs.items():
            body.append(f'<div class="run"><h3>{html.escape(name)}: <span class='
                        f'"{rs[i]["verdict"]}">{rs[i]["verdict"]}</span>; '
                        f'{html.escape(summary(rs[i]))}</h3>{grid(rs[i])}</div>')
        body.append("</div>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<title>What the model forgets</title>'
            f"<style>{CSS}\n.alive{{background:{ALIVE_COLOUR}}}{colours}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def render_png(problems, runs: dict, path: str):
    """The same grids as the page, without the token texts: one row of panels per problem."""
    plt = pyplot("--png")
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    count = rounds_run(runs)
    colours = [ALIVE_COLOUR] + [round_colour(r, count) for r in range(count)]
    layers = next(iter(runs.values()))[0]["rounds"].shape[0]
    fig, axes = plt.subplots(len(problems), len(runs), squeeze=False,
                             figsize=(6 * len(runs), len(problems) * (1.2 + 0.18 * layers) + 0.6))
    for i in range(len(problems)):
        for ax, (name, rs) in zip(axes[i], runs.items()):
            ax.imshow((rs[i]["rounds"] + 1).numpy(), cmap=ListedColormap(colours), vmin=-0.5,
                      vmax=count + 0.5, aspect="auto", interpolation="nearest")
            ax.axvline(rs[i]["prompt_len"] - 0.5, color="black", linewidth=1)
            ax.set_title(f"problem {i + 1}, {name}: {rs[i]['verdict']}; {summary(rs[i])}",
                         fontsize=8)
            ax.set_ylabel("layer", fontsize=8)
            ax.tick_params(labelsize=7)
        axes[i][0].set_xlabel("token (prompt | completion)", fontsize=8)
    handles = [Patch(color=colour, label=f"round {r}" if r else "not evicted")
               for r, colour in enumerate(colours)]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 12), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    save_figure(fig, path, dpi=150)


def parse_args(argv=None):
    p = parser(__doc__)
    settings.add_flags(p, None, ["model"], {"model": "the trained checkpoint (required)"},
                       required=["model"])
    p.add_argument("--before",
                   help="the untrained model of the same task (default: tiny/, or tiny-math/)")
    p.add_argument("--problems", type=int, default=4,
                   help="the first N held-out problems of the run (default 4)")
    p.add_argument("--eviction-rate", type=float, default=0.5,
                   help="ε: the fraction of blocks evicted per round")
    p.add_argument("--out", required=True, help="the HTML page to write")
    p.add_argument("--png", help="also a PNG of the same grids (needs matplotlib)")
    settings.add_flags(p, None, ["device"])
    return p.parse_args(argv)


def check(args):
    """(the run's settings, NGC's evaluation policy, the problems), every flag checked."""
    check_values(args, {"problems": at_least(1)})
    check_output_file(args.out, "--out")
    if args.png:
        check_output_file(args.png, "--png")
        need("matplotlib", "--png")
    args.device = distributed.pick_device(args.device)
    load_config(args.model)  # a missing or foreign checkpoint fails here, before anything is loaded
    cfg = run_defaults(args.model)
    args.before = args.before or BEFORE[cfg.task]
    load_config(args.before)
    run_defaults(args.before, cfg.task, "--before")  # a model of --model's task
    ev = settings.eviction(cfg, args.eviction_rate, greedy=True)  # bad ε: one line
    return cfg, ev, held_out(cfg, args.problems)


def trace_models(args, cfg, problems, ev):
    runs = {}
    for name, path in (("untrained", args.before), ("trained", args.model)):
        model, tokenizer = load(path, args.device, cfg.meta_token)
        check_prompts(cfg, tokenizer, path, problems)
        runs[name] = trace_rollouts(model, tokenizer, cfg, problems, ev)
    return runs


@exits  # bad input: one line, exit code 2; SIGINT, SIGTERM: one line, exit code 130 or 143
def main(argv=None):
    args = parse_args(argv)
    with one_line_errors():
        cfg, ev, problems = check(args)
        runs = trace_models(args, cfg, problems, ev)
    for i in range(len(problems)):
        for name, rs in runs.items():
            print(f"problem {i + 1} {name:>9}: {rs[i]['verdict']:>7}; {summary(rs[i])}")
    models = {"untrained": args.before, "trained": args.model}
    with writing():
        write_text(args.out, render_html(problems, runs, cfg, ev, models))
        print(f"wrote {args.out}")
        if args.png:
            render_png(problems, runs, args.png)
            print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
