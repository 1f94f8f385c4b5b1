"""RULER's task set (experiments/eval/ruler.py, Hsieh et al. 2024) from the shipped texts: every
task at 1k, 4k and 8k context tokens with the real SmolLM2 tokenizer (length on target, the
chat split exact), each task's invariants re-derived here from the decoded text (not taken from
the generator's own checks), needle depth, determinism, RULER's two scorers on hand-made cases,
and the wiring into `kvjax eval` (config, cells' prompts). No model weights except the one test
marked slow."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from experiments.eval import ruler
from experiments.eval.ruler import (METRIC, NIAH_SPECS, NOISE, RULER_TASKS, TOLERANCE, TaskTrial,
                               make, make_task_trials, match_all, match_part, postprocess_pred,
                               score, string_match_all, string_match_part)

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (1024, 4096, 8192)
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def trials(tok):
    """One trial per task and length (seed 5): about a minute on a busy 2-core machine."""
    return {(task, n): make_task_trials(tok, task, n, 1, seed=5)[0]
            for n in LENGTHS for task in RULER_TASKS}


def haystack_of(tok, trial: TaskTrial) -> str:
    """The decoded user text after the instruction's blank line: the haystack."""
    text = tok.decode(trial.context)
    return text.split("\n\n", 1)[1] if "\n\n" in text else text


def count(text: str, s: str) -> int:
    return len(re.findall(rf"(?<![\w-]){re.escape(s)}(?![\w-])", text))


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", RULER_TASKS)
def test_context_is_on_target_and_the_prompt_is_the_encoded_chat(trials, tok, task, length):
    t = trials[task, length]
    assert length - TOLERANCE[task] <= len(t.context) <= length, (task, len(t.context))
    assert TOLERANCE[task] <= (96 if task.startswith("niah_multikey") else 64)
    rendered = tok.decode(t.prompt, skip_special_tokens=False)
    assert tok.encode(rendered, allow_special=True) == t.prompt  # one clean encoding
    assert t.answers and all(a for a in t.answers)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", [t for t in RULER_TASKS if t.startswith("niah")])
def test_niah_needles_keys_and_answers(trials, tok, task, length):
    t = trials[task, length]
    text = tok.decode(t.context)
    question = tok.decode(t.question)
    if task == "niah_multivalue":  # the first four tasks' generator: single-word keys
        spec = ("essay", "word", "numbers", 1, 4, 1)
    else:
        spec = NIAH_SPECS[task]
    haystack, key_kind, value_kind, n_keys, n_values, n_queries = spec
    needles = NEEDLE.findall(text)
    by_key = collections.defaultdict(list)
    for kind, key, value in needles:
        assert kind == value_kind
        by_key[key].append(value)
    asked = re.search(r"special magic \w+ for (.+) mentioned", question).group(1)
    asked = [k for k in re.split(r", and |, ", asked)]
    assert len(asked) == n_queries
    assert sorted(t.answers) == sorted(v for k in asked for v in by_key[k])  # asked keys' values
    assert len(t.answers) == n_queries * n_values
    for a in t.answers:
        assert count(text, a) == 1
        assert re.fullmatch(r"\d{7}", a) if value_kind == "numbers" else UUID.fullmatch(a)
    if key_kind == "uuids":
        assert all(UUID.fullmatch(k) for k in by_key)
    elif key_kind == "words":  # RULER's adjective-noun keys: two prose words
        assert all(re.fullmatch(r"[a-z]+-[a-z]+", k) for k in by_key)
    if haystack == "needle":  # every line is a needle, one per key, one of them asked
        lines = haystack_of(tok, t).split("\n")
        assert all(NEEDLE.fullmatch(line) for line in lines), lines[:3]
        assert len(by_key) == len(needles) > 10 * length // 1024
    else:
        assert len(by_key) == max(n_keys, n_queries) and len(needles) == len(by_key) * n_values
    if haystack == "noise":  # the haystack is the noise paragraph, lines of it, and the needle
        rest = NEEDLE.sub("", haystack_of(tok, t))
        words = " ".join(rest.split())
        assert set(re.findall(r"[A-Za-z]+", words)) <= set(re.findall(r"[A-Za-z]+", NOISE))
        assert words.count("The grass is green.") > length // 40
    if haystack == "essay":  # the shipped prose
        assert "special magic" not in NEEDLE.sub("", haystack_of(tok, t))
        assert len(haystack_of(tok, t)) > 3 * length


@pytest.mark.parametrize("length", LENGTHS)
def test_vt_chain_resolves_to_the_answers(trials, tok, length):
    t = trials["vt", length]
    text = tok.decode(t.context)
    value = re.search(r"assigned the value (\d{5}) in", tok.decode(t.question)).group(1)
    assert count(text, value) == 1
    holders = {value}
    for name, source in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d{5})", text):  # text order
        if source.removeprefix("VAR ") in holders:
            holders.add(name)
    assert holders - {value} == set(t.answers) and len(t.answers) == 5
    assert f"{len(t.answers)} variables are assigned" in tok.decode(t.question)
    example, hay = text.split("\n\n", 1)[1].rsplit(ruler.VT_INSTRUCTION, 1)
    noise = re.sub(r"VAR [A-Z]{5} = (VAR [A-Z]{5}|\d{5})", "", hay)
    assert set(re.findall(r"[A-Za-z]+", noise)) <= set(re.findall(r"[A-Za-z]+", NOISE))
    assert noise.count("The grass is green.") > length // 60  # what the example leaves
    # RULER's one-shot example first: its own chain, question and the answer, all correct
    shown = re.search(r"assigned the value (\d{5}), they are: ([A-Z ]+)\n", example)
    holders = {shown.group(1)}
    for name, source in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d{5})", example):
        if source.removeprefix("VAR ") in holders:
            holders.add(name)
    assert holders - {shown.group(1)} == set(shown.group(2).split()) and len(holders) == 6
    assert not holders & set(t.answers)


@pytest.mark.parametrize("length", LENGTHS)
def test_cwe_answers_are_the_ten_most_common_words(trials, tok, length):
    t = trials["cwe", length]
    text = tok.decode(t.context)
    example, main = text.rsplit(ruler.CWE_INSTRUCTION, 1)
    listed = re.findall(r"\d+\. ([a-z]+)", main)
    counts = collections.Counter(listed)
    freq, rare = (6, 1) if length < 4096 else (30, 3)  # RULER's repeats at this length
    assert sorted(counts, key=counts.get, reverse=True)[:10] and len(t.answers) == 10
    assert {w: counts[w] for w in t.answers} == {w: freq for w in t.answers}
    assert set(c for w, c in counts.items() if w not in t.answers) == {rare}
    assert len(counts) > 10 + length // 200  # many distractor words
    numbers = [int(n) for n in re.findall(r"(\d+)\. [a-z]+", main)]
    assert numbers == list(range(1, len(numbers) + 1))
    assert "Answer: The top 10 words" in example  # RULER's one-shot example comes first
    assert not set(t.answers) & set(re.findall(r"[a-z]+", example))
    assert all(a not in w for a in t.answers for w in counts if w != a)  # no answer inside a word


@pytest.mark.parametrize("length", LENGTHS)
def test_fwe_answers_are_the_three_most_frequent_coded_words(trials, tok, length):
    t = trials["fwe", length]
    words = haystack_of(tok, t).split()
    counts = collections.Counter(words)
    ranked = sorted(counts, key=counts.get, reverse=True)
    assert ranked[0] == "..."  # the noise word, which the question says to ignore
    coded = [w for w in ranked if w != "..."]
    assert tuple(coded[:3]) == t.answers
    assert counts[coded[2]] > counts[coded[3]]  # strictly: the answer is unambiguous
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in coded)
    assert 5 <= len(coded) <= length // 50 - 1  # RULER's length // 50 (Zipf: the rarest 0 times)


@pytest.mark.parametrize("length", LENGTHS)
def test_qa_answer_span_is_in_the_one_document_the_question_quotes(trials, tok, length):
    t = trials["qa", length]
    text = tok.decode(t.context)
    clause = re.search(r'define as "(.+)"\?', tok.decode(t.question)).group(1)
    docs = re.split(r"\n\nDocument \d+:\n|^.*?Document 1:\n", text, flags=re.S)
    docs = [d for d in docs if d]
    holding = [d for d in docs if clause in d]
    assert len(holding) == 1
    (answer,) = t.answers
    assert holding[0].startswith(f"{answer}, ")  # the answer span: the entry's headword
    assert answer.lower() not in clause.lower()
    assert len(docs) > length // 400
    assert METRIC["qa"] == "string_match_part"


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_1",
                                  "niah_multikey_3", "niah_multivalue", "vt", "qa"])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_depth_places_the_first_answer(tok, task, depth):
    (t,) = make_task_trials(tok, task, 1024, 1, seed=2, depth=depth)
    assert t.depth == depth
    hay = haystack_of(tok, t)
    if task == "vt":  # the haystack after the one-shot example
        hay = hay.rsplit(ruler.VT_INSTRUCTION, 1)[1]
        mark = re.search(r"VAR [A-Z]{5} = \d{5}", hay).group(0)
    elif task == "qa":  # the answering document: first, last, or in the middle
        docs = re.findall(r"Document \d+:\n(.*?)(?=\n\nDocument \d+:|$)", hay, re.S)
        k = [i for i, d in enumerate(docs) if d.startswith(f"{t.answers[0]}, ")]
        assert len(k) == 1 and len(docs) >= 3
        assert k[0] == round(depth * (len(docs) - 1)) if depth in (0.0, 1.0) else \
            0 < k[0] < len(docs) - 1
        return
    else:
        mark = next(m.group(0) for m in NEEDLE.finditer(hay) if m.group(3) == t.answers[0])
    at = hay.index(mark) / len(hay)
    assert abs(at - depth) < 0.1, (task, depth, at)
    if task == "vt" and depth == 1.0:  # the chain keeps its order: all of it at the end
        assert hay.rstrip().endswith(f"= VAR {t.answers[-2]}")


def test_seeded_trial_by_trial_and_different_across_seeds(tok):
    for task in ("niah_single_3", "vt", "fwe", "qa"):
        a = make(task, tok, 512, seed=11)
        assert make(task, tok, 512, seed=11) == a
        assert make(task, tok, 512, seed=12)[2] != a[2]
    three = make_task_trials(tok, "niah_multiquery", 512, 3, seed=4)
    two = make_task_trials(tok, "niah_multiquery", 512, 2, seed=4)
    assert three[:2] == two  # trial i comes from its own seed
    assert len({t.answers for t in three}) == 3


def test_the_first_four_tasks_keep_their_draws(tok):
    """`make` on a task of the first four gives make_task_trials' first trial (results recorded
    with those generators still reproduce); a depth moves the needle and keeps the draws."""
    (a,) = make_task_trials(tok, "niah_multivalue", 512, 1, seed=3)
    assert make("niah_multivalue", tok, 512, seed=3) == (a.context, a.question, a.answers)
    assert a.depth is None
    moved = make("niah_multivalue", tok, 512, seed=3, depth=0.0)
    assert moved[2] == a.answers and moved[0] != a.context
    hay = tok.decode(moved[0]).split("\n\n", 1)[1]
    assert hay.startswith(f"One of the special magic numbers for") and a.answers[0] in hay[:80]


def test_bad_arguments_name_the_argument_value_and_range(tok):
    for kwargs, message in [
            (dict(task="trivia"), r"task='trivia': unknown; tasks: niah_multikey"),
            (dict(context_tokens=100), r"context_tokens=100: must be an integer >= 256"),
            (dict(context_tokens=2048.0), r"context_tokens=2048.0: must be an integer"),
            (dict(seed=-1), r"seed=-1: must be an integer >= 0"),
            (dict(depth=1.5), r"depth=1.5: must be a number in \[0, 1\]"),
            (dict(task="cwe", depth=0.5), r"depth=0.5: task 'cwe' has no needle depth"),
            (dict(task="variable_tracking", depth=0.5), r"task 'variable_tracking' has no")]:
        args = dict(task="niah_single_2", context_tokens=1024, seed=0) | kwargs
        with pytest.raises(ValueError, match=message):
            make(args["task"], tok, args["context_tokens"], args["seed"], depth=args.get("depth"))
    with pytest.raises(ValueError, match="trials=0: must be an integer >= 1"):
        make_task_trials(tok, "vt", 1024, 0)
    with pytest.raises(ValueError, match="too small for the instruction"):
        make("cwe", tok, 256, 0)  # the one-shot example and 10 x 6 common words alone are more


def test_scorers_on_hand_made_cases():
    preds = ["The numbers are 1234567 and 7654321.", "It is 1234567.", "no idea"]
    refs = [["1234567", "7654321"], ["1234567", "7654321"], ["1234567"]]
    assert string_match_all(preds, refs) == 50.0  # (1 + 0.5 + 0) / 3
    assert string_match_part(preds, refs) == 66.67  # (1 + 1 + 0) / 3, rounded as RULER
    assert string_match_all(["ABASEMENT"], [["abasement"]]) == 100.0  # case-insensitive
    assert string_match_part(["a fox"], [["Paris", "City of Light"]]) == 0.0
    assert match_all("uuid 3f2a-0001", ["3F2A-0001"]) == 1.0
    assert match_all("12345", ["1234567"]) == 0.0  # a prefix of the answer is not the answer
    assert match_all("1234567", ["12345"]) == 1.0  # substring semantics, as RULER
    assert match_part("City of Light", ["Paris", "city of light"]) == 1.0
    assert postprocess_pred("  VAR\x00ABCDE\tVAR FGHIJ \n") == "VAR\nABCDE\nVAR FGHIJ"
    with pytest.raises(ValueError, match="equally many"):
        string_match_all(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="refs: need at least one"):
        match_all("a", [])


def test_score_uses_each_tasks_ruler_metric():
    assert {t for t, m in METRIC.items() if m == "string_match_part"} == {"qa"}
    qa = TaskTrial("qa", [], [], ("Paris", "City of Light"), 0)
    mv = TaskTrial("niah_multivalue", [], [], ("Paris", "City of Light"), 0)
    assert score(qa, "Answer: Paris") == 1.0  # any reference
    assert score(mv, "Answer: Paris") == 0.5  # every reference counts
    assert score(TaskTrial("vt", [], [], ("ABCDE", "FGHIJ"), 0), "ABCDE\x00FGHIJ") == 1.0


def test_the_eval_grid_names_every_task_and_the_shipped_configs_load(tok):
    from experiments.eval import cells
    from experiments.eval import grid
    from experiments.eval import harness
    from experiments.eval.grid import Cell
    assert set(RULER_TASKS) <= set(grid.RETRIEVAL_TASKS) <= set(grid.TASKS)
    assert grid.RETRIEVAL_TASKS.count("niah_multivalue") == 1
    long = harness.load_config(ROOT / "experiments/configs/ruler_long.toml")
    assert {c.task for c in long.cells} == set(RULER_TASKS)
    assert {c.length for c in long.cells} == {3840, 7936}
    budgets = collections.defaultdict(set)  # RULER's answer budget for every kvjax cell
    for c in long.cells:
        budgets[c.task, c.length, c.method, c.engine].add(c.max_new_tokens)
    for (task, _, _, engine), have in budgets.items():
        assert ruler.TOKENS_TO_GENERATE[task] in have or engine == "kvpress", (task, have)
    assert any(c.engine == "kvpress" for c in long.cells)
    smoke = harness.load_config(ROOT / "experiments/configs/ruler_smoke.toml")
    assert {c.task for c in smoke.cells} == set(RULER_TASKS)
    prompts = cells.make_prompts(Cell("niah_single_2", 512, "full", trials=2, seed=1), tok)
    (want, _) = make_task_trials(tok, "niah_single_2", 512, 2, seed=1)
    assert prompts.contexts[0] == want.context and prompts.questions[0] == want.question
    assert prompts.score(0, f"is {want.answers[0]}.") == 1.0 and prompts.score(0, "") == 0.0


@pytest.mark.slow
def test_a_ruler_cell_runs_on_the_real_model():
    """One cell of the new set through the harness's worker path on SmolLM2 (full cache)."""
    from experiments.eval import harness
    from experiments.eval.grid import Cell
    row = harness.run_cell(Cell("niah_single_1", 512, "full", trials=2, batch=2,
                                max_new_tokens=16))
    assert row["status"] == "ok" and len(row["scores"]) == 2 == len(row["outputs"])
    assert all(s in (0.0, 1.0) for s in row["scores"])


def test_dictionary_documents_and_their_question_sentences():
    entries = ruler.dictionary_entries()
    assert len(entries) == 963 and sum(bool(e.clause) for e in entries) == 764
    first = entries[0]
    assert first.headword == "ABASEMENT" and first.document.startswith("ABASEMENT, n. A decent")
    assert first.clause == ("A decent and customary mental attitude in the presence of wealth "
                            "of power.")
    abdication = next(e for e in entries if e.headword == "ABDICATION")
    assert "Poor Isabella's Dead" in abdication.document  # the verse stays with its entry
    whole = " ".join(e.document for e in entries)
    for e in entries:
        if e.clause:
            assert whole.count(e.clause) == 1 and e.headword.lower() not in e.clause.lower()


def test_the_length_search_finds_the_largest_fit_from_any_guess():
    """`_largest` with a guess (how the generators fit a length in few encodes) returns what
    plain bisection returns, for every threshold, bracket and guess, including bad guesses."""
    for lo, hi in [(0, 0), (0, 1), (0, 7), (3, 40), (0, 1000)]:
        for answer in sorted({lo, (lo + hi) // 2, hi, min(lo + 1, hi)}):
            for guess in [None, lo - 5, lo, answer - 1, answer, answer + 1, hi, hi + 9]:
                calls = []

                def fits(n, answer=answer, calls=calls):
                    calls.append(n)
                    return n <= answer
                assert ruler._largest(fits, lo, hi, guess) == answer, (lo, hi, answer, guess)
                assert all(lo <= n <= hi for n in calls)
    calls = []
    ruler._largest(lambda n: calls.append(n) or n <= 5000, 0, 100_000, 4990)
    assert len(calls) <= 12  # a close guess: a few probes, not 17 bisection steps


def _markdown_table(text: str, header_start: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header line starts with `header_start`,
    cells stripped of spaces and backquotes (the header first)."""
    lines = text.split(header_start, 1)[1].split("\n\n", 1)[0].splitlines()
    cells = lambda line: [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
    return [cells(header_start + lines[0])] + [cells(line) for line in lines[2:]]


def test_the_results_table_is_the_committed_rows():
    """docs/RESULTS.md's 1k table of the RULER set is `docs/results/ruler_smoke/cells.jsonl`,
    cell by cell, and every row is a cell of `ruler_smoke.toml`."""
    import json

    from experiments.eval.grid import cell_of, read_config
    rows = [json.loads(line) for line in
            (ROOT / "docs/results/ruler_smoke/cells.jsonl").read_text().splitlines()]
    config = {c.key for c in read_config(ROOT / "experiments/configs/ruler_smoke.toml").cells}
    assert all(r["status"] == "ok" and cell_of(r).key in config for r in rows)
    by = {(r["task"], r["method"]): r for r in rows}
    for r in rows:  # each score is the mean of its trials' RULER scores
        assert len(r["scores"]) == 5 and r["score"] == pytest.approx(sum(r["scores"]) / 5)
    text = (ROOT / "docs/RESULTS.md").read_text().split("## RULER's task set (issue 52)", 1)[1]
    _, *table = _markdown_table(text, "| task | metric |")
    assert [row[0] for row in table] == list(RULER_TASKS)
    for line in table:
        task, metric, full, snapkv = line
        assert metric == METRIC[task].removeprefix("string_match_")
        assert full == f"{by[task, 'full']['score']:.2f}"
        other = by.get((task, "snapkv:ratio=0.5"))
        assert snapkv == ("-" if other is None else f"{other['score']:.2f}")


@pytest.mark.parametrize("length", [3840, 7936], ids=["4k", "8k"])
def test_results_ruler_tables_are_the_committed_rows(length):
    """docs/RESULTS.md's RULER tables at one length are `docs/results/ruler_long/cells.jsonl`:
    every row a cell of `ruler_long.toml`; every finished cell of that length at RULER's answer
    budget is in the score table with its score; every kvjax/kvpress pair is in the
    side-by-side table with both scores and its count of identical answers (special tokens and
    spacing aside, as the report counts them); a length with no finished cell has no table.
    Recounted here, not through `experiments.eval.ruler_tables`, which writes the tables."""
    import json

    from experiments.eval.grid import cell_of, read_config
    from experiments.eval.report import _normalized, _pairs
    from experiments.eval.ruler_tables import LENGTHS, rewrite
    rows = [json.loads(line) for line in
            (ROOT / "docs/results/ruler_long/cells.jsonl").read_text().splitlines()]
    config = {c.key for c in read_config(ROOT / "experiments/configs/ruler_long.toml").cells}
    assert all(cell_of(r).key in config for r in rows)
    ok = [r for r in rows if r["status"] == "ok" and r["length"] == length]
    grid = {(r["task"], r["method"]): r for r in ok if r["engine"] == "kvjax"
            and r["max_new_tokens"] == ruler.TOKENS_TO_GENERATE[r["task"]]}
    results = (ROOT / "docs/RESULTS.md").read_text()
    text = results.split("## RULER's task set (issue 52)", 1)[1]
    name = LENGTHS[length]
    if not ok:
        assert f"| method ({name}) |" not in text
        assert f"| task ({name}, kvjax beside kvpress) |" not in text
        return
    header, *body = _markdown_table(text, f"| method ({name}) |")
    shown = set()
    for method, *scores in body:
        for task, score in zip(header[1:], scores):
            if score == "":
                assert (task, method) not in grid
                continue
            assert score == f"{grid[task, method]['score']:.2f}", (task, method)
            shown.add((task, method))
    assert shown == set(grid)
    pairs = {(t["task"], t["method"]): (m, t) for m, t in _pairs(ok, ppl=False)}
    assert len(pairs) == sum(r["engine"] == "kvpress" for r in ok)  # every kvpress row paired
    if pairs:
        _, *table = _markdown_table(text, f"| task ({name}, kvjax beside kvpress) |")
        assert len(table) == len(pairs)
        for task, method, kvjax_score, kvpress_score, same in table:
            ours, theirs = pairs[task, method]
            n = sum(_normalized(a) == _normalized(b)
                    for a, b in zip(ours["outputs"], theirs["outputs"]))
            assert (kvjax_score, kvpress_score, same) == (
                f"{ours['score']:.2f}", f"{theirs['score']:.2f}", f"{n}/{theirs['trials']}")
    assert rewrite(results, rows) == results  # the generator writes what is committed


def test_results_mean_scores_are_the_rows_means():
    """The "Over all twelve tasks" means in docs/RESULTS.md are each method's mean kvjax score
    over every task of `ruler_long.toml` at RULER's answer budget, recomputed here from the
    rows (not through `ruler_tables.mean_scores`, which draws the summary plot); the plot is
    committed beside the rows."""
    import json
    import re
    rows = [json.loads(line) for line in
            (ROOT / "docs/results/ruler_long/cells.jsonl").read_text().splitlines()]
    text = " ".join((ROOT / "docs/RESULTS.md").read_text().split())
    line = text[text.index("**Over all twelve tasks**"):text.index("![RULER at 4k and 8k]")]
    names = {"the full cache": "full", "KIVI-4": "kivi:bits=4", "TOVA-0.5": "tova:ratio=0.5",
             "H2O-0.5 + KIVI-4": "h2o:ratio=0.5+kivi:bits=4", "SnapKV-0.5": "snapkv:ratio=0.5",
             "`auto:budget=0.25,table=table`": "auto:budget=0.25,table=table",
             "`auto:budget=0.25` with the end-to-end table": "auto:budget=0.25"}

    def check_mean(quoted: str, method: str, length: int) -> None:
        by_task = {r["task"]: r["score"] for r in rows  # a task's cell, as the table shows it
                   if r["status"] == "ok" and r["length"] == length
                   and r["engine"] == "kvjax" and r["method"] == method
                   and r["max_new_tokens"] == ruler.TOKENS_TO_GENERATE[r["task"]]}
        assert sorted(by_task) == sorted(ruler.RULER_TASKS), (method, length)
        scores = list(by_task.values())
        assert quoted == f"{sum(scores) / len(scores):.3f}", (method, length, quoted)

    for name, method in names.items():
        got = re.search(re.escape(name) + r" (\d\.\d+)(?: at 4k)? and (\d\.\d+)", line)
        assert got, name
        for length, quoted in zip((3840, 7936), got.groups()):
            check_mean(quoted, method, length)
    assert (ROOT / "docs/results/ruler_long/summary.png").stat().st_size > 10_000
