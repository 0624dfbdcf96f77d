"""bench.gpu on a CPU: the tiny mode runs the GPU benchmark's code path (one worker process, the
flagship configs through the trainer's engine and step, compiled and not, the attention-kernel
probe, the EBT-S2 memory probe and plan, the bf16 check, reports) on tiny flavors; the
scheduler's budget, hang guard, crash recovery and stop signals are checked without a GPU too,
and so is every package the benchmark imports against what the GPU machine has."""
import ast
import functools
import importlib.metadata
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trainer_runs as runs
from bench import gpu, gpu_cases
from bench.precision import BF16_GRADIENT_ERRORS, GROUPS
from pretrain.config import gpu_attention, load_config
from pretrain.models import build, resolve
from pretrain.models.replay import replay_store_bytes
from pretrain.training.planner import make_plan

PEAK = 2.0
"""A made-up peak (TFLOP/s) so that MFU is computed on a CPU too."""
CRASHED = "gpt_rec_85m compile=off"
"""The case whose worker the tiny run's fixture kills (SIGKILL) while it runs."""


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """The tiny run, its worker killed in the middle of one case: the cases before it keep their
    figures and a new worker runs the ones after it."""
    out = tmp_path_factory.mktemp("bench-gpu")
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--tiny", "--out", str(out),
                             "--peak-tflops", str(PEAK)], cwd=runs.REPO, env=runs.child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def crashed_case_running() -> bool:
        try:
            report = json.loads((out / "gpu.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        return any(c["case"].startswith(CRASHED) and c["status"] == "running" for c in report["cases"])

    runs.wait_for(crashed_case_running, f"{CRASHED} started", proc, poll_s=0.02)
    os.kill(runs.process_tree(proc.pid)[1], signal.SIGKILL)  # the worker, the benchmark's only child
    output, errors = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:] + errors[-3000:]
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text()


def measured(report: dict) -> dict[str, dict]:
    return {c["case"]: c for c in report["cases"] if not c["case"].startswith(CRASHED)}


def test_a_crashed_worker_keeps_what_was_measured_and_a_new_one_runs_the_rest(tiny_report):
    report, markdown = tiny_report
    plan = [c.name for c in gpu.case_plan(tiny=True)]
    assert [c["case"] for c in report["cases"]] == plan
    crashed = next(c for c in report["cases"] if c["case"].startswith(CRASHED))
    assert crashed["status"] == "crashed" and crashed["error"].startswith("worker exited with code -9")
    assert {c["status"] for c in measured(report).values()} == {"ok"}  # before the crash and after it
    assert report["elapsed_s"] <= report["budget_s"] and report["environment"]["torch"]
    assert f"| {crashed['case']} | crashed: worker exited with code -9" in markdown


def test_each_flagship_config_trains_at_its_own_micro_batch(tiny_report):
    report, _ = tiny_report
    trained = [c for c in measured(report).values() if c["kind"] == "train"]
    assert {c["config"] for c in trained} == {*gpu.FLAGSHIPS, gpu.MEMORY_PROBE[0], gpu.ATTENTION_PROBE[0]}
    for r in trained:
        cfg = load_config(runs.REPO / r["config"], r["overrides"])
        assert r["micro_batch"] == cfg.data.micro_batch_size and r["seq_len"] == 64
        model = build(resolve(cfg.model.flavor, {"vocab_size": 512, "block_size": 64, **cfg.model.overrides}))
        assert r["flavor"] == cfg.model.flavor and r["params"] == model.num_params()
        assert r["flops_per_token"] == model.flops_per_token(64)
        assert r["timed_steps"] == 2 and 0 < r["step_ms_min"] <= r["step_ms_median"]
        assert r["tokens_per_s"] == pytest.approx(r["micro_batch"] * 64 / r["step_ms_median"] * 1e3)
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / (PEAK * 1e12))
        assert r["precision"] == "bf16" and "peak_memory_gib" not in r  # measured on GPU only
        assert abs(r["loss_first"] - math.log(512)) < 1.0  # random tokens: about ln V at init
        assert math.isfinite(r["loss_last"])


def test_compilation_runs_as_each_config_sets_it_and_the_other_way(tiny_report):
    report, _ = tiny_report
    plan = gpu.case_plan(tiny=True)
    for config in gpu.FLAGSHIPS:
        own = load_config(runs.REPO / config).model.compile
        cases = [c for c in plan if c.config == config]
        settings = [c.overrides[-1].removeprefix("model.compile=") for c in cases]
        assert own != "off" and sorted(settings) == ["aot_eager", "off"]  # the CPU's stand-in for inductor
        for case, setting in zip(cases, settings):
            assert case.name.endswith(" (config)") == (setting == (own if own == "off" else "aot_eager"))
    for r in measured(report).values():
        if r.get("config") in gpu.FLAGSHIPS:
            assert r["compile"] == r["overrides"][-1].removeprefix("model.compile=")


def test_the_attention_kernel_is_recorded_next_to_the_prediction(tiny_report):
    report, _ = tiny_report
    nrgpt = next(c for c in report["cases"] if c.get("config") == gpu.ATTENTION_PROBE[0])
    cfg = load_config(runs.REPO / nrgpt["config"], nrgpt["overrides"])
    steps = resolve(cfg.model.flavor).n_steps
    assert (nrgpt["attention"]["predicted"], nrgpt["attention"]["head_dim"]) == gpu_attention(cfg)[:2]
    assert nrgpt["attention"]["ran"] == {"flash (cpu)": steps, "flash (cpu) backward": steps}  # one per step
    assert nrgpt["attention"]["holds"] is None  # a CPU's kernels say nothing about a GPU's
    assert gpu_attention(load_config(runs.REPO / gpu.ATTENTION_PROBE[0])) == ("efficient", 1024, "bf16")  # on a GPU
    # what a GPU's record would say
    assert gpu_cases.prediction_holds("efficient", {"memory-efficient": 12, "memory-efficient backward": 12}) is True
    assert gpu_cases.prediction_holds("flash", {"cudnn": 12, "cudnn backward": 12}) is True
    assert gpu_cases.prediction_holds("efficient", {"math": 12, "math backward": 12}) is False
    assert gpu_cases.prediction_holds("flash", {"flash": 6, "memory-efficient": 6}) is False
    assert gpu_cases.prediction_holds(None, {"flash": 12, "flash backward": 12}) is False  # SDPA nobody expected
    assert gpu_cases.prediction_holds("flash", {}) is False and gpu_cases.prediction_holds(None, {}) is None


def test_the_memory_probe_fills_the_replay_store_and_plans_as_pretrain_plan(tiny_report):
    report, markdown = tiny_report
    probe = next(c for c in report["cases"] if c.get("config") == gpu.MEMORY_PROBE[0])
    assert probe["status"] == "ok" and probe["micro_batch"] == 8
    cfg = load_config(runs.REPO / probe["config"], probe["overrides"])
    config = resolve(cfg.model.flavor, {"vocab_size": 512, "block_size": 64})
    store = probe["replay_store"]
    assert store["rows"] == config.replay_buffer_size == 48 and store["replayed_rows_per_step"] == 4
    assert store["bytes"] == store["planned_bytes"] == replay_store_bytes(config)
    # what `python -m pretrain.plan --gpus 1` says for the config, part by part
    plan = make_plan(probe["config"], cfg, 1, "h200", find_largest=False).parts
    assert probe["plan"] == {**plan.as_dict(), "tensors": plan.tensors, "total": plan.total}
    assert f"store of 48 rows full, {store['bytes'] / 2**30:.2f} GiB" in markdown


def test_the_bf16_check_compares_loss_and_every_gradient_with_float32(tiny_report):
    report, markdown = tiny_report
    check = next(c for c in report["cases"] if c["kind"] == "bf16_check")
    assert check["status"] == "ok" and check["pass"] and check["energy_head_grad_norm"] > 0
    assert check["n_layer"] == resolve("ebt-tiny").n_layer and check["tolerance"] == gpu_cases.bf16_tolerance()
    # the arithmetic the S1 flagship trains
    assert check["energy_gradient"] == load_config(runs.REPO / gpu_cases.BF16_CHECK_CONFIG).model.overrides["energy_gradient"]
    # it really ran in lower precision, and stayed within the stated tolerance
    assert 0 < check["loss_rel_err"] <= check["tolerance"]["loss"]
    assert 0 < check["energy_head_grad_rel_err"] <= check["max_grad_rel_err"] <= check["tolerance"]["grads"]
    assert f"**{check['case']}** (ok): 2 layers, 2 x 64 tokens" in markdown


def test_the_bf16_gradient_tolerance_is_set_from_bench_precisions_figures():
    """The check's tolerance is BF16_MARGIN times the largest gradient error `bench.precision`
    measured in pure bf16, whose record is the table docs/benchmarks.md shows: above every
    figure of that table, and within a few times of the largest."""
    table = (runs.REPO / "docs/benchmarks.md").read_text()
    documented = {}
    for family, groups in BF16_GRADIENT_ERRORS.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {family} | bf16 |"))
        documented[family] = dict(zip(GROUPS, map(float, row.strip(" |").split(" | ")[2:])))
    assert documented == BF16_GRADIENT_ERRORS
    worst = max(error for groups in documented.values() for error in groups.values())
    assert worst < gpu_cases.bf16_tolerance()["grads"] == gpu_cases.BF16_MARGIN * worst <= 3 * worst


def test_cases_run_in_order_of_value_in_parts_whose_caps_fit_the_budget(tiny_report):
    """The memory probe, the bf16 check, each flagship as its config sets it (compiled), the
    attention probe, each flagship the other way; packed into parts whose caps fit the
    budget beside the worker's start-up and the reports' reserve, every flagship as configured
    within the first two (the two runs of one device session). A run of part 1 goes on into the
    later parts on the time left: in the tiny run, whose caps fill 4 parts, all of them ran."""
    plan = gpu.case_plan(tiny=False)
    own = [c for c in plan if c.name.endswith(" (config)")]
    other = [c for c in plan if c.config in gpu.FLAGSHIPS and c not in own]
    assert [c.config for c in own] == list(gpu.FLAGSHIPS)
    assert [c.kind for c in plan[:2]] == ["train", "bf16_check"] and plan[0].fill_replay_store
    assert plan == [*plan[:2], *own, *[c for c in plan if c.config == gpu.ATTENTION_PROBE[0]], *other]
    budget = gpu.BUDGET_S["gpu"]
    packed = gpu.parts(plan, budget)
    assert sorted(c.name for run in packed for c in run) == sorted(c.name for c in plan)
    for run in packed:
        assert gpu.MIN_START_S + sum(c.cap_s for c in run) + gpu.REPORT_RESERVE_S <= budget
        assert run == [c for c in plan if c in run]  # in order of value within a part
    assert packed[0][:2] == plan[:2] and all(case in packed[0] + packed[1] for case in own)
    assert [len(run) for run in gpu.parts(plan, 100)] == [1] * len(plan)  # each cap over the 60 s left

    report, _ = tiny_report
    tiny = gpu.case_plan(tiny=True)
    first, *later = gpu.parts(tiny, report["budget_s"])
    assert later
    assert {c["status"] for c in measured(report).values()} == {"ok"}
    assert len(report["cases"]) == len(tiny)
    # part 1's case (one at the tiny caps) may take what the later parts' cases would get
    caps, in_first = {c.name: c.cap_s for c in tiny}, {c.name for c in first}
    for case in report["cases"]:
        assert (case["cap_s"] >= caps[case["case"]]) if case["case"] in in_first else \
            (case["cap_s"] <= caps[case["case"]]), case


def test_a_case_of_the_part_run_may_take_what_its_earlier_cases_left_unused():
    """The case's cap against the time left: a case of a later part gets at most its cap; one of
    the part being run also what the earlier cases of its part left (here 30 s), but never the
    caps kept for the cases after it in its part (here 100 s)."""
    later_part = gpu.Case("b", "train", 80.0)
    assert gpu_cases.case_cap(later_part, 200.0) == 80.0
    assert gpu_cases.case_cap(later_part, 50.0) == 50.0
    in_part = gpu.Case("a", "train", 80.0, kept_for_later_s=100.0)
    assert gpu_cases.case_cap(in_part, 210.0) == 110.0
    assert gpu_cases.case_cap(in_part, 150.0) == 80.0  # earlier cases overran: still its own cap
    assert gpu_cases.case_cap(in_part, 60.0) == 60.0


def test_the_dry_run_prints_the_wheels_and_the_plan_without_a_gpu():
    """`bench/gpu.sh --dry-run` on this CPU: each carried wheel's file for this python (the
    binary one for its version), then the GPU run's cases in order with their caps."""
    result = subprocess.run(["bash", "bench/gpu.sh", "--dry-run"], cwd=runs.REPO, capture_output=True, text=True,
                            env=runs.child_env(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES=""), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    binary = carried_wheels("BINARY_WHEELS")
    assert "pydantic-core" in binary
    lines = result.stdout.splitlines()
    for name, version in carried_wheels().items():
        tag = f"{python}-*manylinux*_x86_64" if name in binary else "py3-none-any"
        shown = [f"{name}=={version}", f"{name.replace('-', '_')}-{version}-{tag}.whl"]
        assert any(line.split()[:2] == shown for line in lines), (shown, result.stdout)
    packed = gpu.parts(gpu.case_plan(tiny=False), gpu.BUDGET_S["gpu"])
    rows = [line.strip("| ").split(" | ") for line in lines if re.match(r"\| \d+ \|", line)]
    assert rows == [[str(n), case.name, f"{case.cap_s:.0f}"] for n, run in enumerate(packed, 1) for case in run]


def test_markdown_has_one_row_per_training_case(tiny_report):
    report, markdown = tiny_report
    for case in measured(report).values():
        if case["kind"] == "train":
            assert f"| {case['case']} | ok | {case['micro_batch']} x 64 |" in markdown


# ---------------------------------------------------------------------------------------------
# The packages the benchmark imports, against the GPU machine's

REPOSITORY = ("common", "data_pipeline", "pretrain", "bench")
GPU_IMAGE = ("torch", "numpy", "pyyaml", "tensorboard", "tqdm", "xxhash", "psutil", "py-cpuinfo", "msgpack",
             "einops", "packaging", "transformers", "safetensors")
"""What the GPU benchmark machine's image has installed (distributions)."""


def module_file(name: str) -> Path | None:
    path = runs.REPO.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imports_of(module: str) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every import statement of a repository module;
    `from package import name` also yields package.name where that is a module."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.module, in_function))
                found.extend((f"{child.module}.{alias.name}", in_function) for alias in child.names
                             if module_file(f"{child.module}.{alias.name}"))
            visit(child, inside)

    visit(ast.parse(module_file(module).read_text()), False)
    return found


def third_party_imports(roots: list[str], loaded: set[str]) -> dict[str, str]:
    """Top-level package -> a module importing it, over every repository module that `roots`
    reach through module-level imports (and the function-level ones of the benchmark's own
    modules, bench.gpu and bench.gpu_cases): those modules' module-level imports, and their
    function-level ones of the packages in `loaded` (what the run imported: the functions it
    called)."""
    todo, seen, packages = list(roots), set(), {}
    while todo:
        module = todo.pop()
        if module in seen or module == "__future__":
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages above run first
        for name, in_function in imports_of(module):
            top = name.partition(".")[0]
            follow = not in_function or module in ("bench.gpu", "bench.gpu_cases")
            if top in REPOSITORY:
                if follow and module_file(name):
                    todo.append(name)
            elif top not in sys.stdlib_module_names and top != "__future__" and (follow or top in loaded):
                packages.setdefault(top, module)
    return packages


def carried_wheels(array: str | None = None) -> dict[str, str]:
    """The distributions `bench/gpu.sh fetch-wheels` brings, name -> version: those of `array`
    (PURE_WHEELS or BINARY_WHEELS), or of both."""
    script = (runs.REPO / "bench/gpu.sh").read_text()
    pins = {}
    for name in [array] if array else ["PURE_WHEELS", "BINARY_WHEELS"]:
        body = re.search(rf"^{name}=\(([^)]*)\)", script, re.MULTILINE).group(1)
        pins.update(requirement.split("==") for requirement in body.split())
    return pins


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_python() -> str:
    """The GPU machine's Python version: what `bench/gpu.sh fetch-wheels` fetches for."""
    return re.search(r"version=\$\{2:-([0-9.]+)\}", (runs.REPO / "bench/gpu.sh").read_text()).group(1)


def requirement_closure(names) -> set[str]:
    """The distributions `names`, with what they require and so on (as this environment's
    metadata says; markers evaluated for Linux and the image's Python, extras left out)."""
    from packaging.requirements import Requirement

    python = image_python()
    environment = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
                   "platform_system": "Linux", "extra": ""}
    todo, found = [normalized(name) for name in names], set()
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:  # a CUDA build's own (nvidia-*, triton)
            continue
        todo += [normalized(r.name) for r in map(Requirement, requires)
                 if not r.marker or r.marker.evaluate(environment)]
    return found


def on_the_gpu_machine() -> set[str]:
    """The distributions the GPU machine has: the image's, with what they require (pip
    installed that too), and the carried wheels."""
    return requirement_closure(GPU_IMAGE) | {normalized(name) for name in carried_wheels()}


@functools.cache
def providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions(package: str) -> set[str]:
    """The distributions that install the top-level `package`."""
    return {normalized(d) for d in providers().get(package, [package])}


def missing_on_the_gpu_machine(packages: dict[str, str]) -> dict[str, str]:
    """The packages that neither the GPU image nor the carried wheels provide."""
    available = on_the_gpu_machine()
    return {package: module for package, module in packages.items() if not distributions(package) & available}


def test_every_package_the_benchmark_imports_is_on_the_gpu_machine(tiny_report):
    """Those the repository's code imports, and every one that the workers imported that these
    require in turn (DeepSpeed's hjson and pydantic, pydantic's pydantic-core); others, which
    nothing requires, were imported only because they are installed here (fsspec's snappy,
    DeepSpeed's tabulate). The carried wheels are the versions this environment has."""
    report, _ = tiny_report
    imported = report["imported"]  # what the workers imported, functions that ran included
    assert "pretrain.training.planner" in imported["repository"] and "torch" in imported["packages"]
    packages = third_party_imports(["bench.gpu", *imported["repository"]], set(imported["packages"]))
    assert {"torch", "deepspeed", "numpy", "yaml", "xxhash"} <= set(packages)
    # The object store's client is imported inside common.objectstore's functions only, which
    # only s3:// paths reach (the benchmark has none); TensorBoard imports boto3 whenever it is
    # installed, which put it among the packages the run loaded.
    assert not {"boto3", "botocore"} & set(third_party_imports(["common.objectstore"], loaded=set()))
    packages = {top: module for top, module in packages.items()
                if not (top in ("boto3", "botocore") and module == "common.objectstore")}
    assert missing_on_the_gpu_machine(packages) == {}
    needed = requirement_closure(set().union(*map(distributions, packages)))
    required = {package: "required" for package in imported["packages"] if distributions(package) & needed}
    assert {"hjson", "pydantic", "pydantic_core", "annotated_types"} <= set(required)
    assert not {"hjson", "pydantic", "pydantic-core"} & requirement_closure(GPU_IMAGE)  # the wheels bring them
    assert missing_on_the_gpu_machine(required) == {}
    assert {name: importlib.metadata.version(name) for name in carried_wheels()} == carried_wheels()


@pytest.mark.parametrize("module, package", [("data_pipeline.loader", "streaming"),
                                             ("pretrain.downstream.data", "datasets")])
def test_the_import_check_catches_the_data_pipeline(module, package):
    """What the check above would say if bench.gpu imported the data loader or the downstream
    data (as make_plan would, through its manifest lookup)."""
    packages = third_party_imports(["bench.gpu", module], loaded=set())
    assert package in missing_on_the_gpu_machine(packages)


# ---------------------------------------------------------------------------------------------
# Budget, hangs, stop signals, bad input


def test_spent_budget_skips_cases_and_still_writes_reports(tmp_path):
    handlers = [signal.getsignal(signum) for signum in gpu.STOP_SIGNALS]
    assert gpu.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--budget-s", "1"]) == 0
    assert [signal.getsignal(signum) for signum in gpu.STOP_SIGNALS] == handlers  # the caller's again
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert {c["status"] for c in report["cases"]} == {"skipped"}
    assert "skipped: run budget spent" in (tmp_path / "gpu.md").read_text()


def tiny_settings(deadline: float) -> gpu.Settings:
    return gpu.Settings(device="cpu", vocab_size=512, warmup=2, steps=2, peak_tflops=None, deadline=deadline)


def bench_worker_of_this_process() -> int:
    """The benchmark worker that `gpu.run_worker` started from this process, found by its command
    line: this process may have other children, started by the tests it ran before (such as
    multiprocessing's resource tracker, which a dataset's shared memory starts)."""
    def command_line(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # a process that has just ended
            return b""

    workers = [pid for pid in runs.process_tree(os.getpid())[1:]
               if command_line(pid).endswith(b"-m\0bench.gpu\0--worker\0")]
    assert len(workers) == 1, workers
    return workers[0]


def test_a_hung_worker_is_killed_past_the_cap_and_its_case_reported(tmp_path):
    """A worker that no longer answers (stopped here; on a GPU: stuck in a CUDA call or a
    compile, where the alarm's handler never runs) is killed once the case's cap and the grace
    have passed; the case after it is left to another worker."""
    first, second = gpu.case_plan(tiny=True)[:2]  # the memory probe takes seconds
    cases = [gpu.dataclasses.replace(first, cap_s=2.0), second]
    with open(tmp_path / "log", "w") as log:
        records = gpu.run_worker(cases, tiny_settings(time.monotonic() + 120), time.monotonic() + 120, log,
                                 hang_grace_s=1.0)
        start = next(r for r in records if "start" in r)
        worker = bench_worker_of_this_process()
        os.kill(worker, signal.SIGSTOP)
        rest = list(records)
    assert start == {"start": first.name, "cap_s": 2.0}
    assert rest == [{"case": first.name, "status": "timeout",
                     "error": "no answer 1 s past its time cap: worker killed"}]
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_stops_the_worker_and_reports_the_cases_as_stopped(signum, tmp_path):
    """Ctrl-C or a scheduler's SIGTERM to the benchmark: its worker, in a session of its own that
    the signal does not reach, must not keep the device busy, and the report says what happened."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--tiny", "--out", str(tmp_path),
                             "--only", "transformer_pp"], cwd=runs.REPO, env=runs.child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    runs.wait_for(lambda: runs.process_tree(proc.pid)[1:], "the worker started", proc)
    worker = runs.process_tree(proc.pid)[1]
    time.sleep(1.0)  # into the worker's imports
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, out + err
    assert err.strip() == (f"error: stopped by {signal.Signals(signum).name}; {tmp_path / 'gpu.json'} and "
                           "gpu.md report the cases finished before it")
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert {(c["status"], c["error"]) for c in report["cases"]} == {
        ("stopped", f"stopped by {signal.Signals(signum).name}")}
    markdown = (tmp_path / "gpu.md").read_text()
    assert f"| transformer_pp_small compile=off | stopped: stopped by {signal.Signals(signum).name} |" in markdown


def test_a_worker_stopped_by_the_scheduler_reports_its_cases_as_stopped(tmp_path):
    """Under Slurm the job's SIGTERM reaches the worker too: the case it was running and the
    ones after it are reported as stopped, not as a crash, and no other worker takes them."""
    cases = [c for c in gpu.case_plan(tiny=True) if c.name.startswith("gpt_124m")]
    with open(tmp_path / "log", "w") as log:
        records = gpu.run_worker(cases, tiny_settings(time.monotonic() + 120), time.monotonic() + 120, log)
        assert next(r for r in records if "start" in r) == {"start": cases[0].name, "cap_s": cases[0].cap_s}
        time.sleep(0.5)  # into building the engine
        os.kill(bench_worker_of_this_process(), signal.SIGTERM)
        rest = list(records)
    assert [(r["case"], r["status"], r["error"]) for r in rest] == [
        (cases[0].name, "stopped", "stopped by SIGTERM"), (cases[1].name, "stopped", "worker stopped by SIGTERM")]


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu"], "need a GPU"), (["--device", "cpu", "--tiny", "--only", "nothing"], "matches no case")])
def test_bad_invocations_exit_2_with_one_line(args, message, tmp_path, capsys):
    assert gpu.main(args + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
