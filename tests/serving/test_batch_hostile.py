"""issue 38: `tessera batch` keeps its work. Before, a row with a 401-digit number, a lone surrogate
or JSON nested 100,000 deep killed the whole job with no result kept; an unwritable --output was
found only after every row ran; results lived in memory until the end, so an interrupted run lost
every finished row. Now: every bad row is its own error line (a line nested too deep is refused,
naming it, before the model loads), --output is checked before the model loads, results are
journaled beside the output as they finish, and --resume continues an interrupted run to the output
an uninterrupted run writes (compared with one, run here)."""

from __future__ import annotations

import json
import os
import stat

import pytest

pytest.importorskip("tokenizers")

from conftest import cli, cli_error  # noqa: E402

SET_ARGS = ["--set", "layers=1", "--set", "d=32", "--set", "heads=2", "--set", "vocab=50", "--set", "ctx=64"]
HUGE = "1" + "0" * 400


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from test_serve_http import _tokenizer_folder

    return _tokenizer_folder(tmp_path_factory.mktemp("tok"), None)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def _batch(capsys, tokenizer, src, out, *extra):
    return cli(capsys, "batch", "gpt2", *SET_ARGS, "--tokenizer", tokenizer, "--input", src, "--output", out,
               "--threads", 1, "--max-batch", 2, "--max-queue", 1, *extra)


BAD_ROWS = [
    ('{"prompt": [1, 2], "temperature": %s}' % HUGE, "temperature must be a finite number"),
    ('{"prompt": [1, 2], "top_p": -%s}' % HUGE, "top_p must be a finite number"),
    ('{"prompt": [1, 2], "repetition_penalty": %s}' % HUGE, "repetition_penalty"),
    ('{"prompt": [1, 2], "min_p": %s}' % HUGE, "min_p"),
    ('{"prompt": "w1 \\ud800"}', "not valid Unicode"),
    ('{"prompt": "w1", "stop": ["\\udfff"]}', "not valid Unicode"),
    ('{"prompt": "w1", "\\ud800": 1}', "not valid Unicode"),
    ('{"prompt": [1, 2], "seed": -1}', "seed"),
    ('{"prompt": [1, 2], "temperature": 1e-40, "max_tokens": 3}', None),  # fine: greedy
]


def test_every_bad_row_is_its_own_error_line(tmp_path, capsys, tokenizer):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line + "\n" for line, _ in BAD_ROWS) + '{"prompt": [3, 4], "max_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    rc, _, err = _batch(capsys, tokenizer, src, out)
    assert rc == 0, err
    got = _lines(out)
    assert len(got) == len(BAD_ROWS) + 1
    for (line, message), result in zip(BAD_ROWS, got):
        if message is None:
            assert "tokens" in result, result
        else:
            assert message in result.get("error", ""), (line[:60], result)
    assert len(got[-1]["tokens"]) == 2


def test_a_line_nested_too_deep_is_refused_naming_it(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": [1]}\n{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    err = cli_error(capsys, "batch", "gpt2", "--input", src, "--output", tmp_path / "out.jsonl")
    assert "in.jsonl:2: not a JSON line" in err and "nested too deep" in err


def _unwritable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    cases = {"missing folder": (tmp_path / "nope" / "out.jsonl", "does not exist"),
             "a folder": (tmp_path, "is a folder"),
             "empty": ("", "--output"),
             "a device": ("/dev/null", "not a regular file")}
    if os.geteuid() != 0:  # root writes a read-only folder anyway
        cases["read-only folder"] = (ro / "out.jsonl", "cannot write there")
    return cases


@pytest.mark.parametrize("case", ["missing folder", "a folder", "empty", "a device", "read-only folder"])
def test_an_unwritable_output_is_found_before_the_model_loads(tmp_path, capsys, monkeypatch, case):
    from tessera.runtime.serving import batch

    cases = _unwritable(tmp_path)
    if case not in cases:
        pytest.skip("running as root: a read-only folder is writable")
    out, message = cases[case]
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": [1]}\n')

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before --output was checked")

    monkeypatch.setattr(batch, "load_engine", no_model)
    err = cli_error(capsys, "batch", "gpt2", "--input", src, "--output", out)
    assert message in err


ROWS = 12


def _rows(path):
    lines = []
    for i in range(ROWS):
        row = {"prompt": [1 + i % 7, 2 + i % 5, 3], "max_tokens": 3 + i % 4}
        if i % 3 == 1:
            row.update(temperature=0.8, seed=i)
        if i == 5:
            row = {"prompt": [1], "temperature": "hot"}
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_interrupted_run_resumes_to_the_uninterrupted_output(tmp_path, capsys, monkeypatch, tokenizer):
    from tessera.runtime.serving import batch

    src = _rows(tmp_path / "in.jsonl")
    whole = tmp_path / "whole.jsonl"
    rc, _, err = _batch(capsys, tokenizer, src, whole)
    assert rc == 0, err
    assert not (tmp_path / "whole.jsonl.journal").exists()  # removed once the output is written

    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    real, calls = batch.result_of, []

    def interrupting(handle, engine):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(handle, engine)

    monkeypatch.setattr(batch, "result_of", interrupting)
    rc, _, err = _batch(capsys, tokenizer, src, out)
    assert rc == 130, err
    assert out.read_text() == "previous\n"  # the output is replaced only at the end
    journal = tmp_path / "out.jsonl.journal"
    kept = _lines(journal)[1:]
    assert len(kept) >= 5 and "--resume" in err  # five finished rows and the bad row 5
    with open(journal, "a") as f:
        f.write('{"row": 11, "resu')  # a line cut short when the run stopped

    # without --resume the journal is not thrown away
    assert "--resume" in cli_error(capsys, "batch", "gpt2", *SET_ARGS, "--tokenizer", tokenizer, "--input", src,
                                   "--output", out)
    monkeypatch.setattr(batch, "result_of", lambda h, e: (calls.append(2), real(h, e))[1])
    calls.clear()
    rc, _, err = _batch(capsys, tokenizer, src, out, "--resume")
    assert rc == 0, err
    assert out.read_text() == whole.read_text()
    assert len(calls) == ROWS - 1 - len([r for r in kept if "error" not in r["result"]])  # finished rows not rerun
    assert not journal.exists()


def test_resume_refuses_another_runs_journal(tmp_path, capsys, tokenizer):
    src = _rows(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.journal").write_text(json.dumps({"tessera_batch_journal": 1, "fingerprint": "0" * 64,
                                                            "rows": ROWS}) + "\n")
    err = cli_error(capsys, "batch", "gpt2", *SET_ARGS, "--tokenizer", tokenizer, "--input", src, "--output", out,
                    "--resume")
    assert "the journal of another run" in err
    (tmp_path / "out.jsonl.journal").write_text("not a journal\n")
    err = cli_error(capsys, "batch", "gpt2", *SET_ARGS, "--tokenizer", tokenizer, "--input", src, "--output", out,
                    "--resume")
    assert "not a journal" in err
