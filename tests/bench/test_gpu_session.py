"""bench/gpu_session.sh checked here, without a GPU, so that a device lease (15 minutes, drawn by chance) is not spent
on a step that dies at its first line. The script runs in a dry run (tests/bench/gpu_session_dry.py: a stand-in
python3 records every command line as bash expanded it), then, for every step the script defines (new ones
included, read from its `step NAME SECONDS COMMAND` lines): each `python3 -m bench.X ...` is parsed by that module's
own argument parser (and a --preset is a known shape), each pytest step collects every file it names with the
step's own options, each `python3 -c` imports what it names, every TOKENMILL_* variable a step sets is declared in
schemas/settings.py and read, every variable the script takes is documented, the header's device calls name known
steps and fit one lease, and every module the steps import is on the device image or among the wheels
bench/gpu_prepare.sh carries (with those wheels' own needs)."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata as md
import os
import re
import runpy
import subprocess
import sys

import gpu_session_dry as dry
import pytest
from packaging.requirements import Requirement

from schemas import settings

STEPS = dry.defined_steps()
#: The knobs the script documents, set to documented values (a second dry run).
KNOBS = {"PRESET": "qwen3-8b", "THROUGHPUT_ARGS": "--workload both", "BIG_DIR": "/tmp/tm-big", "BIG_SHAPE":
         "qwen2.5-72b", "BIG_ARGS": "--num-prompts 64"}
#: Device seconds: a lease, a machine's start (40 s seen, up to 3 minutes said), a call's transfers, the wait before
#: the next call, one call's most, and what a call's BUDGET_S leaves before its timeout_s.
LEASE_S, START_S, TRANSFER_S, GAP_S, CALL_MAX_S, SUMMARY_S = 900, 180, 20, 15, 600, 15
#: The device machines' Python (bench/gpu_image_packages.txt) for the wheels' environment markers.
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name":
                  "posix", "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name":
                  "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def calls(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, tuple[str, ...], dict[str, str]]]:
    """(step, python3's argv, its TOKENMILL_* variables) of every step, from a dry run with the defaults and one
    with KNOBS set; each distinct command line once."""
    found: dict[tuple[str, tuple[str, ...]], dict[str, str]] = {}
    for env in ({}, KNOBS):
        runs, _ = dry.dry_run(tmp_path_factory.mktemp("dry"), {"STEPS": " ".join(STEPS), **env})
        missing = sorted(set(STEPS) - {s for s, c in runs.items() if c})
        assert missing == [], f"steps that ran no python3 command in the dry run: {missing}"
        for step, records in runs.items():
            for r in records:
                found.setdefault((step, tuple(r["argv"])), r["env"])
    return [(step, argv, env) for (step, argv), env in found.items()]


def test_the_script_is_bash_and_stops_at_an_unknown_step_before_any_work(tmp_path) -> None:
    subprocess.run(["bash", "-n", str(dry.SCRIPT)], check=True)
    proc = subprocess.run(["bash", str(dry.SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                          env={**os.environ, "STEPS": "gpu_tests no_such_step", "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2 and "unknown step 'no_such_step'" in proc.stderr
    assert not (tmp_path / "out").exists()


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
def test_bench_modules_accept_the_steps_arguments(calls, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`python3 -m bench.X ARGS` run as python does (runpy, as __main__), stopped right after its parser took ARGS;
    a --preset must name a known model shape."""
    from engine.loading.presets import preset_config

    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> None:
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    failures = []
    for step, argv, _ in calls:
        if argv[0] != "-m" or not argv[1].startswith("bench."):
            continue
        monkeypatch.setattr(sys, "argv", [argv[1], *argv[2:]])
        try:
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            failures.append(f"{step}: {argv[1]} has no argument parser that stopped it")
        except _Parsed as parsed:
            preset = getattr(parsed.namespace, "preset", None)
            if preset is not None:
                try:
                    preset_config(preset)
                except ValueError as e:
                    failures.append(f"{step}: {' '.join(argv)}: {e}")
        except SystemExit as e:
            failures.append(f"{step}: {' '.join(argv)}: exit {e.code}: {capsys.readouterr().err.strip()[-300:]}")
        except Exception as e:  # an import error, above all
            failures.append(f"{step}: {' '.join(argv)}: {type(e).__name__}: {e}")
    assert failures == [], "\n".join(failures)


def test_pytest_steps_collect_every_file_with_their_options(calls) -> None:
    """Each pytest step's exact options with --collect-only (one process, pytest.main per step: the imports once;
    no assert rewriting and no unraisable-exception hook, whose gc passes at each exit cost a CPU-s and which collecting
    never needs)."""
    runs = [(step, list(argv[2:])) for step, argv, _ in calls if argv[:2] == ("-m", "pytest")]
    assert runs, "no pytest step found"
    for step, args in runs:
        files = [a for a in args if a.endswith(".py")]
        assert files and all((dry.ROOT / f).is_file() for f in files), f"{step}: missing test files in {files}"
    code = ("import sys, pytest\nfor args in " + repr([args for _, args in runs]) + ":\n"
            "    rc = pytest.main([*args, '--collect-only', '--assert=plain', '-p', 'no:unraisableexception'])\n"
            "    print(f'@@@ exit {int(rc)}', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=dry.ROOT, env={**os.environ, "PYTHONPATH": str(dry.ROOT)},
                          capture_output=True, text=True, timeout=180)
    outputs = re.split(r"^@@@ exit (\d+)\n", proc.stdout, flags=re.MULTILINE)
    assert len(outputs) == 2 * len(runs) + 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    for i, (step, args) in enumerate(runs):
        out, rc = outputs[2 * i], outputs[2 * i + 1]
        assert rc == "0", f"{step}: pytest {' '.join(args)} --collect-only exited {rc}:\n{out[-3000:]}"
        empty = [f for f in args if f.endswith(".py") and f"{f}::" not in out]
        assert empty == [], f"{step}: no test of {empty} collected with pytest {' '.join(args)}"


def test_python_c_snippets_import_what_they_name(calls) -> None:
    snippets = [(step, argv[1]) for step, argv, _ in calls if argv[0] == "-c"]
    assert snippets, "no python3 -c in the steps (big_gptq has one)"
    for step, code in snippets:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert missing == [], f"{step}: {node.module} has no {missing}"


def test_tokenmill_variables_are_declared_in_settings_and_read(calls, monkeypatch: pytest.MonkeyPatch) -> None:
    declared = {value: attr for attr, value in vars(settings).items()
                if attr.isupper() and isinstance(value, str) and value.startswith("TOKENMILL_")}
    sources = "".join(p.read_text() for pkg in dry.REPO_PACKAGES for p in sorted((dry.ROOT / pkg).rglob("*.py"))
                      if p.name != "settings.py")
    # what the steps set, not what they inherit from this process (make test's own TOKENMILL_AIRFLOW_TESTS, ...)
    used = {(name, value) for _, _, env in calls for name, value in env.items() if os.environ.get(name) != value}
    used |= {(name, None) for name in re.findall(r"TOKENMILL_[A-Z0-9_]+", dry.SCRIPT.read_text())}
    for name, value in sorted(used, key=str):
        assert name in declared, f"{name} is not one of schemas/settings.py's variables"
        assert f"settings.{declared[name]}" in sources, f"nothing reads {name} (settings.{declared[name]})"
        if value is not None and f"env_flag(settings.{declared[name]}" in sources:
            monkeypatch.setenv(name, value)
            settings.env_flag(name)  # raises for a value the switch does not take


def test_the_variables_the_script_takes_are_documented_and_read() -> None:
    body = dry.script_body()
    comments = "\n".join(line for line in dry.SCRIPT.read_text().splitlines() if line.lstrip().startswith("#"))
    taken = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):?[-+]", body)) - {"PYTHONPATH"}
    assert {"STEPS", "BUDGET_S", "THROUGHPUT_ARGS", "PRESET"} <= taken
    assert sorted(k for k in taken if not re.search(rf"\b{k}\b", comments)) == []
    shown = {k for k in re.findall(r"\b([A-Z][A-Z0-9_]+)=", dry.header()) if not k.startswith("TOKENMILL_")}
    assert sorted(shown - taken) == [], "the header sets variables the script does not read"


def test_the_planned_calls_name_known_steps_and_fit_one_lease() -> None:
    """Calls 1 and 2 (a machine's start, their transfers, timeouts and the waits after them) inside 15 minutes of
    device time; each call's
    BUDGET_S leaves the summary time before its timeout_s; every default step is in some call."""
    plan = dry.planned_calls()
    assert len(plan) >= 2
    for i, call in enumerate(plan, 1):
        assert call.steps and set(call.steps) <= set(STEPS), f"call {i}: unknown steps {set(call.steps) - set(STEPS)}"
        assert call.timeout_s <= CALL_MAX_S and int(call.env["BUDGET_S"]) + SUMMARY_S <= call.timeout_s, f"call {i}"
    first, second = plan[:2]
    assert START_S + first.timeout_s + second.timeout_s + 2 * (TRANSFER_S + GAP_S) <= LEASE_S
    assert {".gpu", ".gpu_w", ".gpu_a"} <= set(first.carry) and {".gpu", ".gpu_b"} <= set(second.carry)
    default = re.search(r"STEPS=\$\{STEPS:-(.*?)\}", dry.script_body(), re.DOTALL)[1].replace("\\\n", " ").split()
    assert sorted(set(default) - {s for c in plan for s in c.steps}) == []


def test_the_device_has_every_module_the_steps_import(calls) -> None:
    entries, snippets = [], []
    for _, argv, _ in calls:
        if argv[:2] == ("-m", "pytest"):
            tests = [dry.ROOT / a for a in argv if a.endswith(".py")]
            entries += tests + [c for t in tests for c in dry.conftests(t)]
        elif argv[0] == "-m" and argv[1].startswith("bench."):
            entries.append(dry.ROOT / (argv[1].replace(".", "/") + ".py"))
        elif argv[0] == "-c":
            snippets.append(argv[1])
    available = {_norm(n) for n in dry.image_packages() + dry.carried_wheels()}
    dists = md.packages_distributions()
    needed = dry.third_party_imports(sorted(set(entries)), snippets)
    assert {"torch", "transformers", "triton"} <= set(needed)
    missing = {top: sorted(set(where))[:3] for top, where in needed.items()
               if not any(_norm(d) in available for d in dists.get(top, [top]))}
    assert missing == {}, "not on the device image (bench/gpu_image_packages.txt) nor in gpu_prepare.sh's WHEELS"


def test_the_carried_wheels_bring_what_they_need() -> None:
    available = {_norm(n) for n in dry.image_packages() + dry.carried_wheels()}
    missing = []
    for dist in dry.carried_wheels():
        try:
            requires = md.requires(dist) or []
        except md.PackageNotFoundError:
            continue  # not installed here: its needs cannot be read
        for req in map(Requirement, requires):
            if (req.marker is None or req.marker.evaluate(DEVICE_MARKERS)) and _norm(req.name) not in available:
                missing.append(f"{dist} needs {req}")
    assert missing == [], "not on the device image nor in bench/gpu_prepare.sh's WHEELS: " + "; ".join(missing)


def test_the_carried_wheels_are_the_locked_versions() -> None:
    """Every wheel bench/gpu_prepare.sh carries is pinned in requirements.lock and fetched under it (pip -c), so the
    device runs the versions the CPU suite was green with, and `make lock` moves both at once."""
    from test_lock import LOCK, read_lock

    locked = read_lock(LOCK)
    assert [d for d in dry.carried_wheels() if _norm(d) not in locked] == []
    text = dry.PREPARE.read_text()
    for command in ("pip download", "pip wheel"):
        line = text[text.index(command):text.index("\n", text.index("-c requirements.lock", text.index(command)))]
        assert "-c requirements.lock" in line and "==" not in line, command
