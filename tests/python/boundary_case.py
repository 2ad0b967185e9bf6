"""One case of the error-boundary suite, run in a process of its own by
test_error_boundary.py: `python boundary_case.py CASE`. It makes one C++
error cross into Python and prints, as its last line, the JSON of what
Python saw: {"type": "module.Name", "message": str(error)}. It catches the
error it provokes and exits normally: a crash (abort, segfault, SystemError
from a foreign C++ runtime) shows as a non-zero exit or a wrong type, not
as a test that passed.

`python boundary_case.py bindings` prints instead where the module's C++
runtime functions were bound (_C._runtime_bindings())."""
import json
import sys
import threading
import time

import torch

import shardema
from shardema import _C


def thrown(kind):
    """_C._throw: the C++ error of `kind`, message "got 1.5" formatted by
    the module's own C++ runtime."""
    return lambda: _C._throw(kind, "got", 1.5)


def schedule_out_of_range():
    shardema.DecaySchedule.constant(1.5)


def small_ema():
    """An EMA of one 256 KiB tensor in several chunks, after step 1 (its
    value 0), the tensor set to 2 for step 2 (decay 0.5: the EMA becomes 1)."""
    w = torch.nn.Parameter(torch.zeros(1 << 16))
    ema = shardema.EMA({"w": w}, schedule=shardema.DecaySchedule.constant(0.5),
                       chunk_mib=0.05)
    ema.update()
    ema.fence()
    with torch.no_grad():
        w.fill_(2.0)
    return ema


def worker_error():
    """Step 2's math throws on a pool worker (failpoint
    offload.pipeline.chunk); the error crosses threads as an exception_ptr
    and wait() rethrows it."""
    ema = small_ema()
    failpoint = _C._Failpoint("offload.pipeline.chunk", 2, 0)
    try:
        ema.update()
        ema.wait()
    finally:
        failpoint.close()


def wait_until_inside(thread, function, seconds=60):
    """Until `thread`'s innermost Python frame is shardema's `function` (it
    has called into the engine, which releases the GIL)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident)
        if frame is not None and frame.f_code.co_name == function and \
                frame.f_code.co_filename.endswith("_ema.py"):
            return
        time.sleep(0.001)
    raise AssertionError(f"the thread never entered {function}()")


def held_engine(body):
    """Runs body() while step 2's math is held inside the engine (a pool
    worker at _C._ChunkGate) and another Python thread is inside wait(),
    GIL released; then lets both finish. Returns body's error."""
    ema = small_ema()
    gate = _C._ChunkGate(step=2, timeout_seconds=60)
    waiter = threading.Thread(target=ema.wait)
    error = None
    try:
        ema.update()
        assert gate.await_arrival(60), "step 2 never reached the gate"
        waiter.start()
        wait_until_inside(waiter, "wait")
        try:
            body()
        except Exception as raised:  # noqa: BLE001 - the error is the result
            error = raised
    finally:
        gate.open()
        if waiter.ident is not None:
            waiter.join(60)
        gate.close()
    assert not gate.timed_out, "the gate timed out"
    assert torch.equal(ema.full_state_dict()["w"], torch.ones(1 << 16)), "step 2 did not finish"
    assert error is not None, "body() raised nothing"
    return error


def worker_error_while_main_raises():
    """A worker's error and the main thread's errors in flight at once: the
    main thread raises ValueError from C++ 200 times while step 2's math
    fails on the pool; wait() then rethrows the worker's error."""
    ema = small_ema()
    failpoint = _C._Failpoint("offload.pipeline.chunk", 2, 0)
    try:
        ema.update()
        for _ in range(200):
            try:
                _C._throw("value", "got", 1.5)
            except ValueError:
                pass
        ema.wait()
    finally:
        failpoint.close()


def torch_keeps_its_translation():
    """A torch function bound with pybind11 (TCPStore.get) after shardema
    was imported: torch's translator, not ours, maps its c10::DistStoreError."""
    import datetime

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(milliseconds=200))
    store.get("missing")


CASES = {
    "c10_value": thrown("value"),
    "c10_type": thrown("type"),
    "c10_index": thrown("index"),
    "c10_not_implemented": thrown("not_implemented"),
    "c10_error": thrown("error"),
    "std_exception": thrown("std"),
    "aten_in_binding": thrown("aten"),
    "api_value": schedule_out_of_range,
    "worker_error": worker_error,
    "error_while_engine_busy": lambda: held_engine(thrown("value")),
    "worker_error_while_main_raises": worker_error_while_main_raises,
    "torch_keeps_its_translation": torch_keeps_its_translation,
}


def main(case):
    if case == "bindings":
        print(json.dumps(_C._runtime_bindings()))
        return
    try:
        error = CASES[case]()
    except Exception as raised:  # noqa: BLE001 - the error is the result
        error = raised
    seen = {"type": None, "message": None}
    if error is not None:
        seen = {"type": f"{type(error).__module__}.{type(error).__qualname__}",
                "message": str(error)}
    sys.stdout.flush()
    print(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1])
