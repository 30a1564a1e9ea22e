"""The math task (paper §5.4): DAPO-Math-17k, AMC and AIME from local .jsonl / .parquet files
(docs/math.md). The reward is 1.0 when the last \\boxed{...} equals the answer after normalisation
(numbers compared exactly; never evaluated). A CPU-sized demo set, with the worked solutions
tiny-math/ was pretrained on: python -m lib.mathtask --make-demo data/math-demo
"""
import json
import os
import random
import re
from dataclasses import dataclass
from fractions import Fraction

from countdown import encode_prompt  # the R1 chat template, shared with Countdown
from lib.cli import (at_least, check_values, exits, make_output_dir, need, one_line_errors,
                     parser, writing)
from lib.files import write_jsonl

@dataclass(frozen=True)
class Problem:
    question: str
    answer: str

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response "
             "should be of the form Answer: $Answer (without quotes) where $Answer is the "
             "answer to the problem.\n\n")
DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'

def _first(row, paths):
    """The value at the first of the dotted paths ("a.b": row[a][b]) that row has, or None."""
    for path in paths:
        value = row
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            return value

def _question(row, field):
    """A row's question (None if none), DAPO's "Answer: ..." wrapper and R1's instruction
    stripped (prompt_text adds it)."""
    value = _first(row, [field] if field else ["prompt", "problem", "question"])
    if isinstance(value, list):  # a chat: [{"role": "user", "content": ...}, ...]
        value = next((m.get("content") for m in value
                      if isinstance(m, dict) and m.get("role") == "user"), None)
    if not isinstance(value, str):
        return None
    value = value.strip().removeprefix(DAPO_HEAD).removesuffix(DAPO_TAIL).removesuffix(INSTRUCTION)
    return value.strip() or None

def _answer(row, field):
    """A row's answer as a string (None if none)."""
    value = _first(row, [field] if field else ["reward_model.ground_truth", "answer"])
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    return str(value).strip() or None

def _rows(path):
    if path.endswith(".parquet"):
        pq = need("pyarrow.parquet", "reading .parquet")
        try:
            return list(enumerate(pq.read_table(path).to_pylist(), 1))
        except Exception as e:  # pyarrow's own errors: truncated, not Parquet at all
            raise ValueError(f"{path}: not a readable Parquet file "
                             f"({str(e).splitlines()[0][:200]})") from None
    if not path.endswith(".jsonl"):
        raise ValueError(f"{path}: expected a .jsonl or .parquet file")
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append((i, json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{i}: not valid JSON ({e.msg}); expected one "
                                         "JSON object per line") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} cannot be "
                         "decoded); save it as UTF-8") from None
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror})") from None
    return rows

def demo_hint(path: str) -> str:
    if os.path.basename(path) not in ("train.jsonl", "test.jsonl"):
        return ""
    return ("; the demo set is not shipped: make it with python -m lib.mathtask --make-demo "
            f"{os.path.dirname(path) or '.'}")


def load(path, question_field=None, answer_field=None):
    """The problems of a .jsonl / .parquet file; a one-line ValueError naming file and line."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file" + (demo_hint(path)
                                                    or " (datasets are local files: docs/math.md)"))
    rows = _rows(path)
    if not rows:
        raise ValueError(f"{path}: no problems in the file")
    problems = []
    for i, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
        question, answer = _question(row, question_field), _answer(row, answer_field)
        fields = ", ".join(map(str, row))
        if question is None:
            raise ValueError(f"{path}:{i}: no question text in "
                             f"{question_field or 'prompt, problem or question'} (its fields: "
                             f"{fields}); name the question's field with --question-field")
        if answer is None:
            raise ValueError(f"{path}:{i}: no answer in "
                             f"{answer_field or 'reward_model.ground_truth or answer'} (its "
                             f"fields: {fields}); name the answer's field with --answer-field")
        problems.append(Problem(question, answer))
    return problems

def prompt_text(problem):  # the question, then R1's math instruction
    q = problem.question
    return q if INSTRUCTION in q else f"{q}\n{INSTRUCTION}"

def encode(tokenizer, problem):
    return encode_prompt(tokenizer, prompt_text(problem))

MAX_ANSWER_CHARS = 1000  # longer boxed answers score 0 (and are not scanned past this)
_BOX = re.compile(r"\\boxed *\{")

def last_boxed(text):
    """The content of the last \\boxed{...}, braces nested; None when there is none, it does not
    close, or it is over MAX_ANSWER_CHARS long."""
    i = max((m.end() - 1 for m in _BOX.finditer(text)), default=None)
    if i is None:
        return None
    depth = 0
    for j in range(i, min(len(text), i + MAX_ANSWER_CHARS + 2)):  # + the box's own two braces
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced, or too long

_TEXT = re.compile(r"\\text\{([^{}]*)\}")
_DROPPED = re.compile(r"\s|\$|\\[!,;:]|\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\^\{?\\circ\}?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_VARIABLE = re.compile(r"[a-zA-Z]=")

def normalize(answer):
    """\\text{..} unwrapped; spaces, $, \\! \\, \\; \\:, \\left, \\right, ^\\circ, thousands
    commas and a leading "x =" dropped; \\dfrac and \\tfrac read as \\frac."""
    s = _TEXT.sub(r"\1", answer)
    s = _DROPPED.sub("", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _VARIABLE.match(s):
        s = s[2:]
    return s

_DECIMAL = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")  # 12, -3, 12.0, 0.5, .5, 5.
_SLASH = re.compile(r"([-+]?\d+)/(\d+)")             # 3/4, -3/4
_FRAC = re.compile(r"([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}")  # \frac{3}{4}, -\frac{3}{4}

def _number(s):
    """The exact value of a normalised integer, decimal or simple fraction, else None."""
    try:
        if _DECIMAL.fullmatch(s):
            return Fraction(s)
        if m := _SLASH.fullmatch(s):
            num, den = int(m[1]), int(m[2])
        elif m := _FRAC.fullmatch(s):
            num, den = int(m[2]) * (-1 if m[1] == "-" else 1), int(m[3])
        else:
            return None
    except ValueError:  # over Python's 4300-digit limit for int(str)
        return None
    return Fraction(num, den) if den else None

def equivalent(given, truth):
    a, b = normalize(given), normalize(truth)
    if not a or not b:
        return False
    x, y = _number(a), _number(b)
    return x == y if x is not None and y is not None else a == b

def reward(completion, problem):
    boxed = last_boxed(completion)
    return 1.0 if boxed is not None and equivalent(boxed, problem.answer) else 0.0

NAMES = ["Tom", "Ana", "Lena", "Ravi", "Mia", "Omar", "Yuki", "Sam"]
# (question with a name n and numbers a, b, c in that order, c drawn given a * b, answer)
TEMPLATES = [
    ("{n} has {a} boxes of {b} apples and gives away {c} apples. How many apples are left?",
     lambda rng, ab: rng.randint(1, ab), lambda a, b, c: a * b - c),
    ("A shelf has {a} rows of {b} books. {n} adds {c} more books. How many books are on the shelf?",
     lambda rng, ab: rng.randint(1, ab), lambda a, b, c: a * b + c),
    ("{n} buys {a} pencils at {b} cents each and pays with {c} cents. How many cents of change "
     "does {n} get?",
     lambda rng, ab: ab + rng.randint(0, 50), lambda a, b, c: c - a * b),
    ("{n} shares {a} bags of {b} marbles equally among {c} friends. How many marbles does each "
     "friend get?",
     lambda rng, ab: rng.choice([d for d in range(2, 13) if ab % d == 0]),
     lambda a, b, c: a * b // c),
]

def demo_problem(rng):
    text, draw_c, answer = rng.choice(TEMPLATES)
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    c = draw_c(rng, a * b)
    return Problem(text.format(n=rng.choice(NAMES), a=a, b=b, c=c), str(answer(a, b, c)))

def demo_splits(seed=0, n_train=2000, n_test=200, patience=100_000):
    """(train, test): distinct problems, reproducible from seed; a ValueError when `patience` draws
    in a row bring no new one (the templates allow about 148,000)."""
    rng, drawn, misses = random.Random(seed), {}, 0  # question -> problem, in the order drawn
    while len(drawn) < n_train + n_test:
        problem = demo_problem(rng)
        misses = misses + 1 if problem.question in drawn else 0
        if misses > patience:
            raise ValueError(f"the demo set has too few distinct problems for {n_train} train "
                             f"and {n_test} held-out ones: ask for fewer (at most about 148,000)")
        drawn.setdefault(problem.question, problem)
    problems = list(drawn.values())
    return problems[n_test:], problems[:n_test]

def make_demo(out_dir, seed=0, n_train=2000, n_test=200):
    """out_dir/train.jsonl and test.jsonl in DAPO's layout (drawn before the folder is made)."""
    train, test = demo_splits(seed, n_train, n_test)
    make_output_dir(out_dir)
    for name, problems in (("train", train), ("test", test)):
        write_jsonl(os.path.join(out_dir, f"{name}.jsonl"), [
            {"data_source": "ngc-demo", "prompt": [{"role": "user", "content": prompt_text(p)}],
             "ability": "MATH", "reward_model": {"style": "rule", "ground_truth": p.answer}}
            for p in problems])
    return train, test

# The demo set's worked solutions: the traces tiny-math/ was pretrained on
DEMO_LAST_STEP = {  # the unit after b -> the last step as (x, op, y), from the total a·b and c
    "apples": lambda total, c: (total, "-", c), "books": lambda total, c: (total, "+", c),
    "cents": lambda total, c: (c, "-", total), "marbles": lambda total, c: (total, "/", c)}

def columns(x, op, y) -> str:
    """x + y, or x - y for x >= y, in columns: the units, the tens with carry or borrow, the sum."""
    (tx, ux), (ty, uy) = divmod(x, 10), divmod(y, 10)
    if op == "+":
        units = ux + uy
        carry = " + 10" if units >= 10 else ""
        tens = 10 * (tx + ty) + 10 * (units >= 10)
        return (f"{ux} + {uy} = {units} , {10 * tx} + {10 * ty}{carry} = {tens} , "
                f"{tens} + {units % 10} = {x + y}")
    borrow = ux < uy
    units = ux + 10 * borrow - uy
    tens = 10 * (tx - ty - borrow)
    return (f"{ux + 10 * borrow} - {uy} = {units} , "
            f"{10 * tx}{' - 10' if borrow else ''} - {10 * ty} = {tens} , "
            f"{tens} + {units} = {x - y}")

def demo_trace(problem) -> str:
    """a groups of b counted up to the total, the last step in columns, `\\boxed { N }`."""
    words = problem.question.split()
    at = [i for i, w in enumerate(words) if w.isdigit()]  # a, b, c in this order
    unit = words[at[1] + 1].rstrip(".") if len(at) == 3 else None
    if unit not in DEMO_LAST_STEP:
        raise ValueError(f"not one of mathtask.TEMPLATES' word problems: {problem.question!r}")
    a, b, c = (int(words[i]) for i in at)
    x, op, y = DEMO_LAST_STEP[unit](a * b, c)
    answer = {"+": x + y, "-": x - y, "/": x // y}[op]
    last = f"{x} / {y} = {answer}" if op == "/" else f"{x} {op} {y} : {columns(x, op, y)}"
    groups = " , ".join(f"{k} : {k * b}" for k in range(1, a + 1))
    return f"{groups} , so {a * b} {unit} . {last} . \\boxed {{ {answer} }}"


@exits  # bad input: one line, exit code 2
def main(argv=None):
    ap = parser("Write the demonstration set of arithmetic word problems (docs/math.md).")
    ap.add_argument("--make-demo", metavar="DIR", required=True,
                    help="output folder for train.jsonl and test.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=2000, help="training problems")
    ap.add_argument("--test", type=int, default=200, help="held-out problems")
    args = ap.parse_args(argv)
    check_values(args, {"train": at_least(1), "test": at_least(1)})
    with one_line_errors(), writing():  # too many problems asked, a file that cannot be written
        train, test = make_demo(args.make_demo, args.seed, args.train, args.test)
    print(f"wrote {len(train)} train and {len(test)} test problems to {args.make_demo}")


if __name__ == "__main__":
    main()
