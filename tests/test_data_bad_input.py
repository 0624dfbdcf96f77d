"""Bad input to `python -m data_pipeline.prepare`: a one-line error naming the cause, exit code 1,
and no output directory (nor any staging leftovers) written."""
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time

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
GOOD_LINES = "".join(json.dumps(r) + "\n" for r in GOOD).encode()
DAMAGED_ZSTD = b"\x28\xb5\x2f\xfd" + bytes(range(64))
"""zstd's magic number, then bytes that are no zstd frame."""


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
    # the hint names the option that reads the text from the field it is in
    "text in another field": (
        lambda d: ["--source", f"jsonl:{jsonl(d / 'o.jsonl', [{'url': 'u', 'content': 'ab', 'n': 1}])}"],
        r"o\.jsonl:1: no string field 'text' \(its string fields: url, content\); pass --text-field "
        r"content, or --skip-bad-lines to skip such lines$"),
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
    "truncated gzip": (
        lambda d: ["--source", f"jsonl:{write(d / 't.jsonl.gz', gzip.compress(GOOD_LINES)[:-40])}"],
        r"t\.jsonl\.gz: a \.gz file that cannot be decompressed \(.*ended before"),
    "damaged zstd": (
        lambda d: ["--source", f"jsonl:{write(d / 'z.jsonl.zst', DAMAGED_ZSTD)}"],
        r"z\.jsonl\.zst: a \.zst file that cannot be decompressed"),
    # documents go to a split whole: one document cannot be split, whatever the fraction
    "one huge document": (
        lambda d: ["--source", f"text:{write(d / 'one.txt', 'word ' * 2000)}", "--val-fraction", "0.5"],
        r"split got no complete window .*\(0 of 1 documents, 0 tokens\); each document goes to one "
        r"split whole \(by a hash of its text\), and 1 document\(s\) are too few to split with "
        r"--val-fraction 0\.5: use more, smaller documents \(e\.g\. --text-unit paragraph\) or "
        r"--val-fraction 0 for no val split$"),
    "too few documents for the val fraction": (
        lambda d: ["--source", f"jsonl:{jsonl(d / 'f.jsonl', GOOD[3:8])}", "--val-fraction", "0.05"],
        r"the val split got no complete window .* too few to split with --val-fraction 0\.05: use "
        r"more, smaller documents, a larger --val-fraction than 0\.05 or --val-fraction 0"),
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
    from data_pipeline.tokenizing import _load_tokenizer, _tokenize_unit
    from data_pipeline.sources import DataError

    _load_tokenizer({"tokenizer": "char", "chars": ["a"]}, 0.0)
    with pytest.raises(DataError) as failure:
        _tokenize_unit(["aab"])
    assert str(failure.value) == ("tokenizing a chunk of 1 documents failed: ValueError: "
                                  "character 'b' is not in the char vocabulary")


def test_ctrl_c_reaching_the_tokenizer_processes_is_left_to_the_parent():
    """Ctrl-C signals the whole process group: the workers ignore it (no traceback of theirs,
    no broken pool) and the parent alone stops the run."""
    import signal

    from data_pipeline.tokenizing import tokenized_chunks
    from trainer_runs import process_tree

    docs = [f"document {i} " * 40 for i in range(256 * 12)]
    before = set(process_tree(os.getpid()))
    # the forked workers start with Python's Ctrl-C handler, also where this process was
    # started with SIGINT ignored (a background job of a shell without job control)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        results = tokenized_chunks(iter(docs), {"tokenizer": "gpt2"}, 0.0, num_proc=2)
        first = next(results)
    finally:
        signal.signal(signal.SIGINT, inherited)
    for worker in set(process_tree(os.getpid())) - before:
        os.kill(worker, signal.SIGINT)
    try:
        chunks = [first, *results]
    except KeyboardInterrupt:  # a worker's, handed to the parent as its chunk's result
        pytest.fail("the tokenizer processes took Ctrl-C")
    expected = list(tokenized_chunks(iter(docs), {"tokenizer": "gpt2"}, 0.0, num_proc=1))
    assert [[t.tolist() for t in c.tokens] for c in chunks] == [[t.tolist() for t in c.tokens] for c in expected]


def test_a_killed_tokenizer_process_fails_the_run_instead_of_hanging():
    import signal

    from data_pipeline.tokenizing import tokenized_chunks
    from data_pipeline.sources import DataError
    from trainer_runs import process_tree

    docs = [f"document {i} " * 40 for i in range(256 * 40)]  # 40 chunks, 12 in flight
    before = set(process_tree(os.getpid()))
    results = tokenized_chunks(iter(docs), {"tokenizer": "gpt2"}, 0.0, num_proc=2)
    next(results)
    workers = sorted(set(process_tree(os.getpid())) - before)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    with pytest.raises(DataError, match=r"^a tokenizer process died \(killed, e.g. out of memory\)"):
        for _ in results:
            pass


def test_gzip_and_zstd_files_read_as_their_text(tmp_path, capsys):
    """Compressed jsonl and text files give the very dataset their plain text gives; they are
    recognized by their first bytes (in a directory also by their name), and decompressed as a
    stream."""
    import zstd

    lines = [b"".join(l + b"\n" for l in GOOD_LINES.splitlines()[i::3]) for i in range(3)]
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    for name, data in zip("abc", lines):
        write(plain / f"{name}.jsonl", data)
    write(packed / "a.jsonl.gz", gzip.compress(lines[0]))
    write(packed / "b.jsonl.zst", zstd.compress(lines[1]))
    write(packed / "c.jsonl", gzip.compress(lines[2]))  # compressed, named as plain text
    manifests = []
    for folder in (plain, packed):
        code, err, out = run_cli(capsys, folder, "--source", f"jsonl:{folder}", "--num-proc", "2")
        assert code == 0, err
        manifests.append(json.load(open(os.path.join(out, "manifest.json"))))
    assert manifests[0]["splits"]["train"]["docs"] == len(GOOD)
    assert manifests[1]["splits"] == manifests[0]["splits"]
    assert manifests[1]["fingerprint"] == manifests[0]["fingerprint"]
    from data_pipeline.sources import parse_source
    text = "caf\u00e9 one\n\nparagraph two\nand more\n"
    write(tmp_path / "t.txt.zst", zstd.compress(text.encode()))
    docs = list(parse_source(f"text:{tmp_path}/t.txt.zst", text_unit="paragraph").documents())
    assert docs == ["caf\u00e9 one", "paragraph two\nand more"]


def test_bytes_that_are_not_utf8_are_a_warning_naming_the_files(tmp_path, capsys):
    folder = tmp_path / "texts"
    folder.mkdir()
    write(folder / "latin1.txt", "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e\n".encode("latin-1") * 10)
    write(folder / "utf8.txt", "Caf\u00e9 cr\u00e8me\n" * 10)
    code, err, out = run_cli(capsys, tmp_path, "--source", f"text:{folder}", "--tokenizer", "char")
    assert code == 0, err
    latin1 = str(folder / "latin1.txt")
    assert json.load(open(os.path.join(out, "manifest.json")))["invalid_utf8_by_file"] == {latin1: 40}
    assert err.splitlines() == [
        f"warning: 40 byte sequence(s) that are not UTF-8 became U+FFFD, in 1 file(s): {latin1} (40); "
        "if the input is in another encoding (e.g. Latin-1), convert it to UTF-8 (iconv -f latin1 "
        "-t utf-8) and prepare again with --overwrite"]
    code, err, _ = run_cli(capsys, tmp_path / "texts", "--source", f"text:{folder}/utf8.txt")
    assert code == 0 and err == ""


def big_corpus(folder) -> str:
    """Text files that take the tokenizer processes seconds (one document per file, 24 MB)."""
    folder.mkdir()
    words = " ".join(f"w{(i * 7919) % 5003:x}" for i in range(200_000))
    for i in range(24):
        write(folder / f"{i:02d}.txt", f"file {i}: {words}")
    return f"text:{folder}"


@pytest.mark.parametrize("signum, num_proc, whole_group", [
    (signal.SIGTERM, 2, False),  # kill PID
    (signal.SIGTERM, 2, True),  # a scheduler's preemption, scancel
    (signal.SIGINT, 1, True),  # Ctrl-C, also when tokenizing in the main process
])
def test_a_stop_signal_stops_preparing_in_one_line_leaving_nothing(tmp_path, signum, num_proc, whole_group):
    """Mid-tokenization, SIGTERM ends the command as Ctrl-C does: one line, 128 + the signal,
    the tokenizer processes gone, no staging directory left."""
    from trainer_runs import REPO, child_env, process_tree, terminal_sigint, wait_for

    source = big_corpus(tmp_path / "corpus")
    proc = subprocess.Popen([sys.executable, "-m", "data_pipeline.prepare", "--source", source,
                             "--out", str(tmp_path / "out"), "--num-proc", str(num_proc),
                             "--val-fraction", "0"],
                            cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=terminal_sigint)
    try:
        wait_for(lambda: any(tmp_path.glob(".out.incomplete-*")) and len(process_tree(proc.pid)) > num_proc - 1,
                 "the tokenizing begun", proc)
        if num_proc == 1:
            time.sleep(1)  # into the tokenizing (here, in the main process), which takes seconds
        workers = process_tree(proc.pid)[1:]
        (os.killpg if whole_group else os.kill)(proc.pid, signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, err[-3000:]
    expected = "error: interrupted" if signum == signal.SIGINT else \
        "error: stopped by SIGTERM: nothing was written; rerun the same command to prepare the dataset"
    assert err.strip().splitlines() == [expected]
    assert sorted(os.listdir(tmp_path)) == ["corpus"]
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}") for pid in workers):
        assert time.monotonic() < deadline, "tokenizer processes outlived the command"
        time.sleep(0.05)
