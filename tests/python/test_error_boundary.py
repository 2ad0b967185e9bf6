"""The C++ -> Python error boundary, case by case, each case in a process of
its own (boundary_case.py) so that a crash fails one case instead of
killing pytest: the exact exception type, its one-line message and exit
code 0, for every error type the bindings map (python/src/errors.cpp), an
error thrown inside ATen from a binding, a worker thread's error rethrown
through an exception_ptr, errors raised while other threads are inside the
engine, and torch's own errors after shardema is imported; every case again
with TORCH_SHOW_CPP_STACKTRACES=1 (c10::Error then captures a backtrace
through the interpreter's frames).

Then where the module's C++ runtime calls were bound by the dynamic loader:
libstdc++ / libgcc_s, never a torch library, never a copy of its own; and
that it calls no std::filesystem function (which torch exports broken
copies of: shardema/core/file_system.h).

A module linked with -static-libstdc++ fails here (its messages lose their
numbers, "got 1.5" becomes "got ", and its runtime is its own copy), and so
does a process with LLVM's libc++abi preloaded (every error becomes
SystemError); docs/testing.md says how to see both. The second toolchain
stage of .ci/run (scripts/second_toolchain.sh) runs this file on a module
built with clang."""
import concurrent.futures
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ONE_CASE_SECONDS = 180  # a case takes ~3 s (importing torch) on a quiet machine

# case -> (Python's exception type, its message: the exact text, or a
# pattern that pins what the boundary carries, the numbers and the inner
# error, where the wording belongs to the library and may change).
WORKER_FAULT = re.compile(
    r"shardema\.EMA\.wait: .*\(chunk 0 of \d+\): injected fault \(failpoint "
    r"offload\.pipeline\.chunk\) in chunk 0 of step 2\. .*")
EXPECTED = {
    "c10_value": ("builtins.ValueError", "got 1.5"),
    "c10_type": ("builtins.TypeError", "got 1.5"),
    "c10_index": ("builtins.IndexError", "got 1.5"),
    "c10_not_implemented": ("builtins.NotImplementedError", "got 1.5"),
    "c10_error": ("builtins.RuntimeError", "got 1.5"),
    "std_exception": ("builtins.RuntimeError", "got"),
    "aten_in_binding": ("builtins.RuntimeError", "shape '[3]' is invalid for input of size 2"),
    "api_value": ("builtins.ValueError", re.compile(r".*\b1\.5\b.*\[0, 1\].*")),
    "worker_error": ("builtins.RuntimeError", WORKER_FAULT),
    "error_while_engine_busy": ("builtins.ValueError", "got 1.5"),
    "worker_error_while_main_raises": ("builtins.RuntimeError", WORKER_FAULT),
    "torch_keeps_its_translation": (
        "torch.distributed.DistStoreError", "wait timeout after 200ms, keys: /missing"),
}
# Errors torch's own translator maps: with TORCH_SHOW_CPP_STACKTRACES=1 it
# appends torch's C++ backtrace to the message, as it does without shardema.
TORCH_TRANSLATES = {"torch_keeps_its_translation"}
STACKTRACES = {"plain": {}, "TORCH_SHOW_CPP_STACKTRACES=1": {"TORCH_SHOW_CPP_STACKTRACES": "1"}}
RUNS = [(case, env) for env in STACKTRACES for case in EXPECTED]


def run_case(case, extra_env):
    env = dict(os.environ, **extra_env)
    try:
        done = subprocess.run([sys.executable, str(HERE / "boundary_case.py"), case], env=env,
                              capture_output=True, text=True, timeout=ONE_CASE_SECONDS)
    except subprocess.TimeoutExpired as timeout:
        return {"returncode": "timeout", "stdout": timeout.stdout, "stderr": timeout.stderr}
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


@pytest.fixture(scope="module")
def outcomes():
    """Every (case, environment) run, two processes at a time."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {run: pool.submit(run_case, run[0], STACKTRACES[run[1]]) for run in RUNS}
        return {run: future.result() for run, future in futures.items()}


def what_python_saw(outcome):
    lines = (outcome["stdout"] or "").strip().splitlines()
    assert outcome["returncode"] == 0 and lines, (
        f"the case's process ended with {outcome['returncode']}:\n"
        f"{outcome['stdout']}\n{(outcome['stderr'] or '')[-3000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("case, env", RUNS, ids=[f"{c}-{e}" for c, e in RUNS])
def test_the_error_crosses_with_its_type_and_message(outcomes, case, env):
    seen = what_python_saw(outcomes[(case, env)])
    expected_type, expected = EXPECTED[case]
    stderr = f"stderr:\n{(outcomes[(case, env)]['stderr'] or '')[-3000:]}"
    assert seen["type"] == expected_type, f"{seen}\n{stderr}"
    if case in TORCH_TRANSLATES and STACKTRACES[env]:
        assert "C++ CapturedTraceback" in seen["message"]
        seen["message"] = seen["message"].splitlines()[0]
    if isinstance(expected, str):
        assert seen["message"] == expected, stderr
    else:
        assert expected.fullmatch(seen["message"]), f"{seen['message']!r}\n{stderr}"
    assert "\n" not in seen["message"]


def module_path():
    spec = importlib.util.find_spec("shardema")  # without importing torch here
    found = sorted(pathlib.Path(spec.origin).parent.glob("_C.*.so"))
    assert len(found) == 1, found
    return found[0]


# Function -> the libraries it may be bound to.
RUNTIME = re.compile(r"/libstdc\+\+\.so\.6$")
UNWINDER = re.compile(r"/libgcc_s\.so\.1$")
BOUND_TO = {
    "__cxa_throw": RUNTIME,
    "__cxa_rethrow": RUNTIME,
    "__cxa_begin_catch": RUNTIME,
    "__cxa_allocate_exception": RUNTIME,
    "std::rethrow_exception": RUNTIME,
    "std::current_exception": RUNTIME,
    "_Unwind_RaiseException": UNWINDER,
    "_Unwind_Resume": UNWINDER,
}


def test_the_module_binds_the_cpp_runtime_to_libstdcxx_and_libgcc_s():
    outcome = run_case("bindings", {})
    lines = (outcome["stdout"] or "").strip().splitlines()
    assert outcome["returncode"] == 0 and lines, outcome
    bound = json.loads(lines[-1])
    # Reported, not required: exception_ptr's reference counting, which
    # libtorch_cpu.so re-exports, binds to torch's copy unless libstdc++
    # comes first in the lookup order; the cases above pass either way.
    print({name: bound[name] for name in bound if "exception_ptr" in name})
    wrong = {name: bound.get(name) for name, allowed in BOUND_TO.items()
             if not allowed.search(bound.get(name) or "")}
    assert not wrong, f"bound elsewhere than libstdc++.so.6 / libgcc_s.so.1: {wrong}"
    assert pathlib.Path(bound["this module"]).resolve() == module_path().resolve()


def test_the_module_calls_no_std_filesystem_function():
    imported = subprocess.run(["nm", "-D", "--undefined-only", str(module_path())],
                              capture_output=True, text=True, check=True).stdout
    assert any(line.split()[:1] == ["U"] for line in imported.splitlines())  # the imports
    filesystem = [line.split()[-1] for line in imported.splitlines() if "St10filesystem" in line]
    assert not filesystem, f"the module imports std::filesystem: {filesystem[:5]}"
