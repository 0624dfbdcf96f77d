"""The docs cannot rot: every command, config file and config key that README.md and docs/*.md
name exists. Each `python -m MODULE` (or `torchrun ... -m MODULE`) answers --help with exit
status 0, each `configs/...` path exists (a glob matches a file, `{a,b}` names each of a and b),
and each `section.key=` override is a field of the run config, `model.overrides.NAME` a field of
some model flavor's config."""
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

COMMAND = re.compile(r"(?<![\w-])-m\s+([A-Za-z_]\w*(?:\.\w+)*(?:\|\w+)*)")
"""The module of a `python -m MODULE` (also `.venv/bin/python -m`, `torchrun ... -m`), or the
modules of `python -m bench.data|models|ebt`; it may follow on the next line of a wrapped code
span."""
CONFIG_PATH = re.compile(r"(?<![\w/.-])configs/(?:\{[^{}\s]*\}|[^\s`'\"(),|{}])*")
OVERRIDE_KEY = re.compile(r"(?<![\w./$-])([a-z_]\w*(?:\.[a-z_]\w*)+)=")
PLACEHOLDERS = {"pretrain.X", "key.sub"}
"""What the docs write for any command (`python -m pretrain.X`) and any key (`key.sub=value`)."""


@dataclasses.dataclass
class Named:
    """What markdown files name, each with where it is first named (FILE:LINE)."""

    commands: dict[str, str] = dataclasses.field(default_factory=dict)
    config_paths: dict[str, str] = dataclasses.field(default_factory=dict)
    config_keys: dict[str, str] = dataclasses.field(default_factory=dict)


def named_in(files: list[Path]) -> Named:
    """The commands, config paths and config keys that `files` name, placeholders left out."""
    named = Named()
    for path in files:
        text = path.read_text()

        def where(match: re.Match) -> str:
            line = text.count("\n", 0, match.start()) + 1
            return f"{path.name}:{line}"

        for match in COMMAND.finditer(text):
            first, *others = match.group(1).split("|")
            package = first.rpartition(".")[0]
            for module in [first, *(f"{package}.{name}" for name in others)]:
                if module not in PLACEHOLDERS:
                    named.commands.setdefault(module, where(match))
        for match in CONFIG_PATH.finditer(text):
            config_path = match.group(0).rstrip(".:;")  # the end of a sentence
            if "<" not in config_path and "..." not in config_path:  # configs/<name>.yaml
                named.config_paths.setdefault(config_path, where(match))
        for match in OVERRIDE_KEY.finditer(text):
            if match.group(1) not in PLACEHOLDERS:
                named.config_keys.setdefault(match.group(1), where(match))
    return named


HELP_RUNNER = """
import json, os, runpy, sys, tempfile, traceback
import torch, numpy  # what nearly every command imports, once: each --help then costs a fork
results = {}
for module in sys.argv[1:]:
    sys.stdout.flush(); sys.stderr.flush()
    stderr = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the command as `python -m MODULE --help` runs it, in a process of its own
        os.dup2(stderr.fileno(), 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.argv = [module, "--help"]
        code = 0
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    stderr.seek(0)
    results[module] = [os.waitstatus_to_exitcode(status), stderr.read().decode(errors="replace")]
print(json.dumps(results))
"""
"""Runs `MODULE --help` for each module given, each in a forked child of one interpreter that
has imported torch once (an interpreter per command spent a minute of CPU on imports)."""


def failing_helps(commands: dict[str, str]) -> list[str]:
    """`python -m MODULE --help` for each module: why each that did not exit 0 failed."""
    done = subprocess.run([sys.executable, "-c", HELP_RUNNER, *sorted(commands)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    problems = []
    for module, (code, stderr) in json.loads(done.stdout.strip().splitlines()[-1]).items():
        if code != 0:
            last_line = (stderr.strip().splitlines() or [""])[-1]
            problems.append(f"{commands[module]}: python -m {module} --help exited {code}: {last_line}")
    return problems


def _expand_braces(path: str) -> list[str]:
    """`configs/tiny/{gpt,ebt}.yaml` -> `configs/tiny/gpt.yaml`, `configs/tiny/ebt.yaml`."""
    braces = re.search(r"\{([^{}]*)\}", path)
    if braces is None:
        return [path]
    return [expanded for option in braces.group(1).split(",")
            for expanded in _expand_braces(path[:braces.start()] + option + path[braces.end():])]


def missing_config_paths(config_paths: dict[str, str]) -> list[str]:
    missing = []
    for named, where in config_paths.items():
        for path in _expand_braces(named):
            exists = any(REPO.glob(path)) if "*" in path else (REPO / path).exists()
            if not exists:
                missing.append(f"{where}: {path} does not exist")
    return missing


def _field_names(node) -> set[str]:
    return {field.name for field in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else set()


def unknown_config_keys(config_keys: dict[str, str]) -> list[str]:
    from pretrain.config import RunConfig, get_key
    from pretrain.models import FLAVORS

    # model.overrides is untyped in the run config: its keys are the fields of the flavor's config
    model_fields = set().union(*map(_field_names, FLAVORS.values()))
    defaults = RunConfig()
    unknown = []
    for key, where in config_keys.items():
        section, _, name = key.rpartition(".")
        if section == "model.overrides":
            known = name in model_fields
        else:
            try:
                node = get_key(defaults, section)
            except AttributeError:
                node = None
            known = name in _field_names(node)
        if not known:
            unknown.append(f"{where}: {key} is not a config key")
    return unknown


def test_every_command_the_docs_name_answers_help():
    commands = named_in(DOC_FILES).commands
    assert {"pretrain.train", "data_pipeline.prepare", "tests.cluster"} <= set(commands)
    assert failing_helps(commands) == []


def test_every_config_path_the_docs_name_exists():
    config_paths = named_in(DOC_FILES).config_paths
    assert "configs/tiny/gpt.yaml" in config_paths
    assert missing_config_paths(config_paths) == []


def test_every_config_key_the_docs_name_is_a_key_of_the_run_config():
    config_keys = named_in(DOC_FILES).config_keys
    assert {"train.max_steps", "model.overrides.n_embd"} <= set(config_keys)
    assert unknown_config_keys(config_keys) == []


def test_a_missing_command_config_path_or_key_is_reported(tmp_path):
    """The checks above on a page that names one of each that exists and one of each that does
    not: only the missing ones are reported, each where it is named."""
    page = tmp_path / "page.md"
    page.write_text(
        "Train with `python -m pretrain.train --config configs/tiny/gpt.yaml train.max_steps=5`\n"
        "or `.venv/bin/python -m pretrain.nonexistent --config configs/nope.yaml`,\n"
        "overriding `train.no_such_key=1 model.overrides.n_embd=64 model.overrides.no_such_field=2`;\n"
        "any of `configs/tiny/{gpt,nope}.yaml` or `configs/owt/*_nope.yaml`.\n"
        "Measure with `python -m bench.data|models`.\n")
    named = named_in([page])
    assert named.commands == {"pretrain.train": "page.md:1", "pretrain.nonexistent": "page.md:2",
                              "bench.data": "page.md:5", "bench.models": "page.md:5"}
    problems = failing_helps({"pretrain.nonexistent": "page.md:2"})
    assert len(problems) == 1
    assert problems[0].startswith("page.md:2: python -m pretrain.nonexistent --help exited 1: ")
    assert "No module named pretrain.nonexistent" in problems[0]
    assert missing_config_paths(named.config_paths) == [
        "page.md:2: configs/nope.yaml does not exist",
        "page.md:4: configs/tiny/nope.yaml does not exist",
        "page.md:4: configs/owt/*_nope.yaml does not exist"]
    assert unknown_config_keys(named.config_keys) == [
        "page.md:3: train.no_such_key is not a config key",
        "page.md:3: model.overrides.no_such_field is not a config key"]
