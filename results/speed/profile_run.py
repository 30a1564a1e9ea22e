"""Where a training run's time went, summed from its log.jsonl (every step records its rollout and
replay seconds, every evaluation its own; docs/training.md). profile.txt beside it is this on the
runs of docs/speed.md (then `scripts/bench.py --profile`; the run before them logged no phases):

    python results/speed/profile_run.py RUN_DIR [RUN_DIR ...]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from lib.cli import Error, exits, parser  # noqa: E402
from lib.rundir import read_log  # noqa: E402


def profile(run_dir: str):
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        raise Error(f"{run_dir} has no log.jsonl; give a run directory train.py wrote")
    log = read_log(path)
    steps, evals = [r for r in log if "reward" in r], [r for r in log if "eval" in r]
    if not steps:
        raise Error(f"{path} has no step records to profile")
    total = sum(r["step_time"] for r in steps)
    rollouts, replays = sum(r["rollout_time"] for r in steps), sum(r["replay_time"] for r in steps)
    print(f"{run_dir}: {len(steps)} steps ({total:.1f} s), {len(evals)} evaluations")
    for name, sec in [("rollouts", rollouts), ("replay fwd+bwd", replays),
                      ("rest of the steps", total - rollouts - replays)]:
        print(f"  {name:30s} {sec:7.1f} s  {sec / len(steps):6.2f} s/step")
    for record in evals:
        print(f"  evaluation at step {record['step']:<11d} {record['eval_time']:7.1f} s"
              if "eval_time" in record
              else f"  evaluation at step {record['step']}: its time was not recorded")


@exits  # a missing or broken log: one line
def main(argv=None):
    flags = parser(__doc__)
    flags.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                       help="run directories train.py wrote")
    for run_dir in flags.parse_args(argv).run_dirs:
        profile(run_dir)


if __name__ == "__main__":
    main()
