"""Bad input to `python -m data_pipeline.prepare`: a one-line error naming the cause, exit code 1,
and no output directory (nor any staging leftovers) written."""
import json
import os
import re
import subprocess
import sys

import pytest

from data_pipeline.prepare import main


def write(path, text: str | bytes):
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(path, mode) as f:
        f.write(text)
    return str(path)


def jsonl(path, records) -> str:
    return write(path, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                               for r in records))


def many_characters(folder) -> str:
    """A text with 70,000 distinct characters: its char vocabulary cannot be stored as uint16."""
    return write(folder / "u.txt", "".join(map(chr, range(0xE000, 0xE000 + 70_000))))


GOOD = [{"text": f"document number {i} with a few words in it"} for i in range(40)]


def run_cli(capsys, tmp_path, *args: str) -> tuple[int, str, str]:
    out = str(tmp_path / "out")
    code = main(["--out", out, "--seq-len", "8", "--val-fraction", "0", "--num-proc", "1",
                 *args])
    return code, capsys.readouterr().err, out


CASES = {
    "unknown source": (lambda d: ["--source", "imagenet"], r"unknown source 'imagenet'"),
    "unknown source kind": (lambda d: ["--source", "csv:x.csv"], r"unknown source 'csv:x.csv'"),
    "missing path": (lambda d: ["--source", f"jsonl:{d}/nope.jsonl"],
                     r"jsonl:.*nope\.jsonl: no such file or directory"),
    "glob matching nothing": (lambda d: ["--source", f"text:{d}/*.txt"], r"no files match"),
    "empty file": (lambda d: ["--source", f"text:{write(d / 'e.txt', '')}"], r"e\.txt: empty"),
    "no documents": (lambda d: ["--source", f"jsonl:{jsonl(d / 'n.jsonl', [{'text': ''}] * 3)}"],
                     r"jsonl:.*n\.jsonl holds no documents"),
    "line not JSON": (lambda d: ["--source", f"jsonl:{jsonl(d / 'c.jsonl', GOOD + ['{oops'])}"],
                      r"c\.jsonl:41: not valid JSON"),
    "line without text": (
        lambda d: ["--source", f"jsonl:{jsonl(d / 'f.jsonl', GOOD[:3] + [{'body': 'x'}])}"],
        r"f\.jsonl:4: no string field 'text'"),
    "text field not a string": (
        lambda d: ["--source", f"jsonl:{jsonl(d / 'g.jsonl', [{'text': 3}] + GOOD)}"],
        r"g\.jsonl:1: no string field 'text'"),
    "seq-len below 1": (lambda d: ["--source", "shakespeare", "--seq-len", "0"],
                        r"--seq-len must be an integer >= 1, got 0"),
    "val fraction out of range": (lambda d: ["--source", "shakespeare", "--val-fraction", "1.5"],
                                  r"--val-fraction must be in \[0, 1\)"),
    "corpus smaller than a window": (
        lambda d: ["--source", f"jsonl:{jsonl(d / 's.jsonl', GOOD[:1])}", "--seq-len", "512"],
        r"the train split got no complete window of 513 tokens"),
    "unknown compression": (lambda d: ["--source", "shakespeare", "--compression", "rar"],
                            r"unknown --compression 'rar'"),
    "token id beyond uint16": (lambda d: ["--source", f"text:{many_characters(d)}", "--tokenizer",
                                          "char"], r"token id 70000 does not fit uint16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_cleanly(case, tmp_path, capsys):
    make_args, message = CASES[case]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    code, err, out = run_cli(capsys, tmp_path, *make_args(inputs))
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert sorted(os.listdir(tmp_path)) == ["inputs"]  # no output, no staging leftovers


def test_bad_lines_can_be_skipped_and_are_counted(tmp_path, capsys):
    corpus = jsonl(tmp_path / "c.jsonl", GOOD[:20] + ["{oops", {"body": 1}] + GOOD[20:])
    code, _, out = run_cli(capsys, tmp_path, "--source", f"jsonl:{corpus}", "--skip-bad-lines")
    assert code == 0
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["skipped_lines"] == 2 and manifest["splits"]["train"]["docs"] == len(GOOD)


def test_existing_different_dataset_is_refused_unless_overwrite(tmp_path, capsys):
    corpus = jsonl(tmp_path / "c.jsonl", GOOD)
    assert run_cli(capsys, tmp_path, "--source", f"jsonl:{corpus}")[0] == 0
    code, err, out = run_cli(capsys, tmp_path, "--source", f"jsonl:{corpus}", "--tokenizer",
                             "char")
    assert code == 1 and "already holds a different dataset (tokenizer='gpt2' there" in err
    assert json.load(open(os.path.join(out, "manifest.json")))["tokenizer"] == "gpt2"
    code, _, _ = run_cli(capsys, tmp_path, "--source", f"jsonl:{corpus}", "--tokenizer", "char",
                         "--overwrite")
    assert code == 0 and json.load(open(os.path.join(out, "manifest.json")))["tokenizer"] == "char"
    # A directory that is not a dataset is never written into, even with --overwrite.
    write(tmp_path / "notes.txt", "mine")
    code = main(["--source", f"jsonl:{corpus}", "--out", str(tmp_path), "--overwrite"])
    assert code == 1 and "holds no dataset" in capsys.readouterr().err


def test_a_damaged_manifest_is_refused_in_one_line_and_rebuilt_with_overwrite(tmp_path, capsys):
    corpus = jsonl(tmp_path / "c.jsonl", GOOD)
    code, _, out = run_cli(capsys, tmp_path, "--source", f"jsonl:{corpus}")
    assert code == 0
    manifest = os.path.join(out, "manifest.json")
    write(manifest, open(manifest).read()[:50])  # cut short
    code, err, _ = run_cli(capsys, tmp_path, "--source", f"jsonl:{corpus}")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"error: {manifest}: not a readable JSON file (")
    assert err.rstrip().endswith("; pass --overwrite to rebuild the dataset")
    assert run_cli(capsys, tmp_path, "--source", f"jsonl:{corpus}", "--overwrite")[0] == 0
    assert json.load(open(manifest))["splits"]["train"]["docs"] == len(GOOD)


def test_command_line_exit_status(tmp_path):
    done = subprocess.run([sys.executable, "-m", "data_pipeline.prepare", "--source",
                           f"jsonl:{tmp_path}/missing.jsonl", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: jsonl:{tmp_path}/missing.jsonl: no such file or directory"]
    assert not os.path.exists(tmp_path / "o")


def test_failure_in_a_tokenizer_process_reads_like_one_in_the_main_process(tmp_path, capsys):
    """The token-id check runs where the tokenizing does: in a worker with --num-proc 2."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    corpus = many_characters(inputs)
    errors = []
    for num_proc in ("1", "2"):
        code = main(["--source", f"text:{corpus}", "--tokenizer", "char", "--out",
                     str(tmp_path / "out"), "--seq-len", "8", "--val-fraction", "0",
                     "--num-proc", num_proc])
        errors.append(capsys.readouterr().err)
        assert code == 1
    assert errors[0] == errors[1]
    assert errors[0].count("\n") == 1 and errors[0].startswith("error: token id 70000")
    assert sorted(os.listdir(tmp_path)) == ["inputs"]


def test_lone_surrogates_are_replaced_and_counted(tmp_path, capsys):
    # Raw lines: JSON escapes of a lone high and a lone low surrogate, and a valid pair (an
    # emoji), which is one character and no replacement.
    lines = [r'{"text": "broken \ud800 high"}', r'{"text": "and \udfff low, \ud83c\udfad fine"}']
    corpus = write(tmp_path / "s.jsonl", "\n".join(lines + [json.dumps(r) for r in GOOD]) + "\n")
    code, err, out = run_cli(capsys, tmp_path, "--source", f"jsonl:{corpus}", "--num-proc", "2")
    assert code == 0, err
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["lone_surrogate_replacements"] == 2
    assert manifest["invalid_utf8_replacements"] == 0
    assert manifest["splits"]["train"]["docs"] == len(GOOD) + 2
    from data_pipeline.sources import parse_source
    docs = list(parse_source(f"jsonl:{corpus}").documents())
    assert docs[:2] == ["broken \ufffd high", "and \ufffd low, \U0001F3AD fine"]


def test_jsonl_and_text_files_may_start_with_a_byte_order_mark(tmp_path, capsys):
    from data_pipeline.sources import parse_source
    bom = b"\xef\xbb\xbf"
    corpus = write(tmp_path / "b.jsonl", bom + "".join(json.dumps(r) + "\n" for r in GOOD).encode())
    code, err, out = run_cli(capsys, tmp_path, "--source", f"jsonl:{corpus}")
    assert code == 0, err
    assert json.load(open(os.path.join(out, "manifest.json")))["splits"]["train"]["docs"] == len(GOOD)
    text = write(tmp_path / "t.txt", bom + "first paragraph\n\nsecond".encode())
    for unit in ("file", "paragraph"):
        docs = list(parse_source(f"text:{text}", text_unit=unit).documents())
        assert docs[0].startswith("first paragraph") and "\ufeff" not in "".join(docs)


def test_any_exception_in_a_unit_of_work_becomes_one_line():
    from data_pipeline.prepare import _init_worker, _tokenize_unit
    from data_pipeline.sources import DataError

    _init_worker({"tokenizer": "char", "chars": ["a"]}, 0.0)
    with pytest.raises(DataError) as failure:
        _tokenize_unit(["aab"])
    assert str(failure.value) == ("tokenizing a chunk of 1 documents failed: ValueError: "
                                  "character 'b' is not in the char vocabulary")


def test_ctrl_c_reaching_the_tokenizer_processes_is_left_to_the_parent():
    """Ctrl-C signals the whole process group: the workers ignore it (no traceback of theirs,
    no broken pool) and the parent alone stops the run."""
    import signal

    from data_pipeline.prepare import _tokenized_chunks
    from trainer_runs import process_tree

    docs = [f"document {i} " * 40 for i in range(256 * 12)]
    before = set(process_tree(os.getpid()))
    # the forked workers start with Python's Ctrl-C handler, also where this process was
    # started with SIGINT ignored (a background job of a shell without job control)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        results = _tokenized_chunks(iter(docs), {"tokenizer": "gpt2"}, 0.0, num_proc=2)
        first = next(results)
    finally:
        signal.signal(signal.SIGINT, inherited)
    for worker in set(process_tree(os.getpid())) - before:
        os.kill(worker, signal.SIGINT)
    try:
        chunks = [first, *results]
    except KeyboardInterrupt:  # a worker's, handed to the parent as its chunk's result
        pytest.fail("the tokenizer processes took Ctrl-C")
    expected = list(_tokenized_chunks(iter(docs), {"tokenizer": "gpt2"}, 0.0, num_proc=1))
    assert [[t.tolist() for t in c.tokens] for c in chunks] == [[t.tolist() for t in c.tokens] for c in expected]


def test_a_killed_tokenizer_process_fails_the_run_instead_of_hanging():
    import signal

    from data_pipeline.prepare import _tokenized_chunks
    from data_pipeline.sources import DataError
    from trainer_runs import process_tree

    docs = [f"document {i} " * 40 for i in range(256 * 40)]  # 40 chunks, 12 in flight
    before = set(process_tree(os.getpid()))
    results = _tokenized_chunks(iter(docs), {"tokenizer": "gpt2"}, 0.0, num_proc=2)
    next(results)
    workers = sorted(set(process_tree(os.getpid())) - before)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    with pytest.raises(DataError, match=r"^a tokenizer process died \(killed, e.g. out of memory\)"):
        for _ in results:
            pass
