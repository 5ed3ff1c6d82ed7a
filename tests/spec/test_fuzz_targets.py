"""The long-run harness of the hypothesis targets (tests/fuzz_targets.py), checked in-process and in
well under a second: its cases are the targets' own strategies, seeded; its worker loop tells a
passing case from a traceback and a memory blow-up; a kept case replays. The bounds themselves (the
CPU/wall limit, RLIMIT_AS, a dead worker) are fuzz_specs.run_cases's, which test_fuzz.py checks with
real worker processes."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest

pytest.importorskip("hypothesis")
import fuzz_targets  # noqa: E402

TARGET = "input_limits_metadata"  # no fixtures: the cheapest target


def test_every_target_of_the_issue_is_listed():
    names = set(fuzz_targets.targets())
    assert {"report_arguments", "generate_arguments", "run_arguments", "alignment_arguments", "load_arguments",
            "kv_cache_metadata", "input_limits_metadata", "mapping_files", "config_json", "tokenizer_json",
            "safetensors_headers", "completion_bodies", "chat_bodies", "raw_bodies",
            "header_sets", "chat_templates", "batch_rows"} <= names  # the last three: issue 38


def test_cases_are_drawn_from_the_targets_strategies_and_seeded():
    test = fuzz_targets.targets()[TARGET]
    a, b = fuzz_targets.draw_cases(test, 12, seed=3), fuzz_targets.draw_cases(test, 12, seed=3)
    assert len(a) == 12 and [c["args"] for c in a] == [c["args"] for c in b]
    assert [c["id"] for c in a] == list(range(12))
    assert all(set(pickle.loads(c["args"])) == {"value"} for c in a)  # the test's one given argument
    assert len({c["args"] for c in a}) > 6  # varied, not one case twelve times
    assert [c["args"] for c in fuzz_targets.draw_cases(test, 12, seed=4)] != [c["args"] for c in a]


def test_the_worker_loop_classifies_each_case():
    test = fuzz_targets.targets()[TARGET]
    good = fuzz_targets.draw_cases(test, 1, seed=1)[0]
    cases = [good, {**good, "id": 1, "selftest": "{}['missing']"}, {**good, "id": 2},
             {**good, "id": 3, "selftest": "raise MemoryError"}, {**good, "id": 4}]
    parent, child = mp.Pipe()
    for case in cases:
        parent.send(case)
    parent.send(None)
    fuzz_targets._target_worker(child, 0, TARGET)  # in this process: no address-space cap (0)
    got = []
    while parent.poll():
        got.append(parent.recv())
    # a memory blow-up ends the worker (a fresh one takes over in run_cases), so case 4 is not run here
    assert [g[0] for g in got] == ["ok", "traceback", "ok", "memory"]
    assert "KeyError: 'missing'" in got[1][2] and "MemoryError" in got[3][2]


def test_a_kept_case_is_a_reproducer(tmp_path, capsys):
    test = fuzz_targets.targets()[TARGET]
    case = fuzz_targets.draw_cases(test, 5, seed=2)[4]
    kept = fuzz_targets._keep(tmp_path, TARGET, {**case, "status": "hang", "detail": "over 20 s of CPU"})
    assert kept.exists() and "arguments: {'value':" in kept.with_suffix(".txt").read_text()
    assert fuzz_targets.main(["--replay", str(kept)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("passed")
