"""HSDP's replicas and the files: one replica writes, the others wait for
its word (shardema.EMA.save_checkpoint and export_weights under a 2-D
mesh). Collectives over the replicas' own process group, through
torch.distributed."""
from typing import Any, Callable, List, Optional

import torch


def write_on_first_replica(replicas: Any, write: Callable[[], None], timeout_s: float,
                           api: str) -> None:
    """Runs `write` (a collective of the shard group that writes files:
    save_checkpoint, export_weights) on the first replica only, the mesh's
    first index of its replicate dimension (global rank 0's under
    init_device_mesh). HSDP's replicas hold the same EMA: one set of files,
    not one per replica racing for the same names. The other replicas wait
    for their peer on the first replica and raise its error, so the call
    returns on every rank once the files are complete or failed.

    The waiters bound the writer's silence, not its work: while `write`
    runs, a thread of the writer tells its replicas every quarter of the
    EMA's timeout (`timeout_s`) that it is still writing, and a waiter
    fails only when `timeout_s` passes with no word from it (a writer that
    never comes, or is gone), as a peer that never comes fails the engine's
    own collectives, instead of the process group's 30 minutes. An export
    larger than the timeout takes to write completes on every replica."""
    if replicas is None:
        write()
        return
    import torch.distributed as dist
    writer = dist.get_global_rank(replicas, 0)
    device = _collective_device(replicas)
    if dist.get_rank(replicas) != 0:
        _wait_for_writer(writer, replicas, device, timeout_s, api)
        return
    import threading
    done = threading.Event()
    lost: List[BaseException] = []

    def still_writing() -> None:
        if device.type == "cuda":  # NCCL: the device is per thread
            torch.cuda.set_device(device)
        while not done.wait(_heartbeat_interval(timeout_s)):
            try:
                _broadcast_within(torch.tensor([_WRITING], dtype=torch.int64, device=device),
                                  writer, replicas, timeout_s, api)
            except RuntimeError as error:  # a waiter is gone: the end says so
                lost.append(error)
                return

    heartbeat = threading.Thread(target=still_writing, name="shardema-hsdp-writing",
                                 daemon=True)
    heartbeat.start()
    message = b""
    raised: Optional[BaseException] = None
    try:
        write()
    except Exception as error:  # every replica learns it below
        raised = error
        message = f"{type(error).__name__}: {error}".encode()
    finally:
        # The last word goes after the thread's, in the order the waiters read.
        done.set()
        heartbeat.join()
    if not lost:
        length = torch.tensor([len(message)], dtype=torch.int64, device=device)
        _broadcast_within(length, writer, replicas, timeout_s, api)
        if message:
            _broadcast_within(torch.tensor(list(message), dtype=torch.uint8, device=device),
                              writer, replicas, timeout_s, api)
    if raised is not None:
        raise raised
    if lost:
        raise lost[0]



#: What the first replica's heartbeat says in place of an outcome's length.
_WRITING = -1



def _heartbeat_interval(timeout_s: float) -> float:
    """A quarter of the waiters' bound (several beats fit in it however
    late one is), and no busier than 20 a second for tiny timeouts."""
    return max(timeout_s / 4.0, 0.05)



def _wait_for_writer(writer: int, replicas: Any, device: torch.device, timeout_s: float,
                     api: str) -> None:
    """A waiting replica's side: heartbeats until the outcome's length, then
    the writer's error text if it failed."""
    while True:
        length = torch.empty(1, dtype=torch.int64, device=device)
        _broadcast_within(length, writer, replicas, timeout_s, api)
        if int(length.item()) != _WRITING:
            break
    if int(length.item()):
        text = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        _broadcast_within(text, writer, replicas, timeout_s, api)
        raise RuntimeError(f"shardema.EMA.{api}: the first HSDP replica, which writes the files, "
                           f"failed: {bytes(text.cpu().tolist()).decode(errors='replace')}")



def _collective_device(group: Any) -> torch.device:
    """Where `group`'s backend takes tensors: the host for Gloo (also a
    "cpu:gloo,cuda:nccl" group), the current GPU for NCCL alone."""
    import torch.distributed as dist
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())



def _broadcast_within(tensor: torch.Tensor, source: int, group: Any, timeout_s: float,
                      api: str) -> None:
    """dist.broadcast of `tensor` from global rank `source` over `group`,
    waiting at most `timeout_s` (Work.wait's own bound; the group's
    timeout would apply otherwise). RuntimeError saying who did not come:
    on the writer (`source`) its replicas, elsewhere the writer."""
    import torch.distributed as dist
    from datetime import timedelta
    work = dist.broadcast(tensor, src=source, group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as error:
        if dist.get_rank() == source:
            raise RuntimeError(f"shardema.EMA.{api}: waited {timeout_s:g} s (the EMA's timeout) "
                               "for the other HSDP replicas to take word of the files from this "
                               "rank, which writes them, and they did not: a rank of theirs is "
                               f"gone or out of step ({error})") from error
        raise RuntimeError(f"shardema.EMA.{api}: waited {timeout_s:g} s (the EMA's timeout) for "
                           f"the first HSDP replica (global rank {source}), which writes the "
                           "files, and it did not report back: a rank of it is gone or out of "
                           f"step ({error})") from error
