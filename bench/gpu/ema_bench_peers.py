"""The EMAs bench/gpu/ema_bench.py trains with, each written the way its
project does it (the file and version modelled are named in each class),
behind one small interface:

    before_step()   right before optimizer.step(): what the project waits
                    for there (shardema: fence(); NeMo: join())
    update(step)    right after optimizer.step()
    sources_read()  blocks until this update's device-to-host copies are done
    complete()      blocks until the update is entirely done
    ema_of(name)    the EMA of a parameter, as a CPU float64 tensor

DECAY is a constant decay for every method (0.99, so 30 steps move the EMA
far enough for the float64 check to see a wrong one). On a machine without
CUDA each runs its CPU stand-in: the same arithmetic with no streams and no
pinning, for the --tiny end-to-end check."""
import threading
from typing import Optional

import torch

DECAY = 0.99


def cuda_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Method:
    name = "?"
    where = "?"  # where the EMA lives and its dtype
    d2h = False  # whether it copies the weights device -> host each update

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device

    def before_step(self) -> None:
        pass

    def update(self, step: int) -> None:
        pass

    def sources_read(self) -> None:
        cuda_sync(self.device)

    def complete(self) -> None:
        cuda_sync(self.device)

    def ema_of(self, name: str) -> Optional[torch.Tensor]:
        return None

    def close(self) -> None:
        self.complete()


class NoEma(Method):
    name = "none"
    where = "-"


class GpuForeach(Method):
    """timm's ModelEmaV3 (huggingface/pytorch-image-models,
    timm/utils/model_ema.py: apply_update_ lerps every floating state-dict
    entry with one torch._foreach_lerp_), with dtype=torch.float32 so the
    EMA of bf16 weights is fp32 beside them on the GPU. Without timm (or a
    timm whose ModelEmaV3 takes no dtype) the same _foreach_lerp_ over fp32
    copies, written out (ema-pytorch's use_foreach path does the same)."""
    name = "GPU fp32 _foreach_lerp_"

    def __init__(self, model):
        super().__init__(model)
        self.timm = None
        try:
            from timm.utils.model_ema import ModelEmaV3
            self.timm = ModelEmaV3(model, decay=DECAY, dtype=torch.float32, foreach=True)
            self.where = "beside the weights (float32), timm ModelEmaV3"
        except (ImportError, TypeError):
            self.params = dict(model.named_parameters())
            self.emas = {n: p.detach().float().clone() for n, p in self.params.items()}
            self.where = "beside the weights (float32), hand-written"

    def update(self, step):
        with torch.no_grad():
            if self.timm is not None:
                self.timm.update(self.model)
                return
            names = list(self.params)
            torch._foreach_lerp_([self.emas[n] for n in names],
                                 [self.params[n].detach().float() for n in names], 1 - DECAY)

    def ema_of(self, name):
        if self.timm is not None:
            return self.timm.module.state_dict()[name].detach().double().cpu()
        return self.emas[name].double().cpu()


class TorchtitanOffload(Method):
    """torchtitan's EMA with offload_to_cpu (pytorch/torchtitan,
    torchtitan/components/ema.py: EMAOptimizersContainer._init_cpu_offload
    and _update_offloaded): the EMA is a clone of each parameter (its dtype)
    pinned on the host; each update waits for the previous one's event,
    then on a side stream that waits for the training stream copies the EMA
    host-to-device into a device scratch the size of the model, lerps it
    with the weights there, copies it device-to-host back, and records an
    event. Nothing is waited for before the next optimizer step."""
    name = "torchtitan-style offload"
    d2h = True

    def __init__(self, model):
        super().__init__(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        cuda = self.device.type == "cuda"
        self.emas = [p.detach().cpu().pin_memory() if cuda else p.detach().clone()
                     for p in self.params]
        self.scratch = None  # made at the first update, as torchtitan's _get_scratch
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.pending = None
        dtype = str(self.params[0].dtype).replace("torch.", "")
        self.where = (f"pinned host ({dtype}) + a device scratch of the model's size" if cuda
                      else f"host ({dtype}) + a scratch of the model's size (CPU stand-in)")

    def _wait_pending(self):
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None

    def update(self, step):
        self._wait_pending()
        if self.scratch is None:
            self.scratch = [torch.empty_like(p) for p in self.params]
        with torch.no_grad():
            if self.stream is None:  # the CPU stand-in: the same three steps
                torch._foreach_copy_(self.scratch, self.emas)
                torch._foreach_lerp_(self.scratch, self.params, 1 - DECAY)
                torch._foreach_copy_(self.emas, self.scratch)
                return
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                torch._foreach_copy_(self.scratch, self.emas, non_blocking=True)  # H2D
                torch._foreach_lerp_(self.scratch, self.params, 1 - DECAY)
                torch._foreach_copy_(self.emas, self.scratch, non_blocking=True)  # D2H
                self.pending = torch.cuda.Event()
                self.pending.record(self.stream)

    def sources_read(self):
        self._wait_pending()

    def complete(self):
        self._wait_pending()

    def ema_of(self, name):
        self._wait_pending()
        return self.emas[self.names.index(name)].double()


class NemoCpuThread(Method):
    """NeMo's EMAOptimizer with device=cpu (NVIDIA/NeMo,
    nemo/collections/common/callbacks/ema.py at 94bd346): the EMA is a copy
    of each parameter (its dtype) in host memory; after optimizer.step(),
    on a side stream that waits for the training stream,
    param.data.to('cpu', non_blocking=True) copies every weight out (ATen
    pins the result of a non-blocking device-to-host .to(): _to_copy's
    pin_out), and a threading.Thread synchronizes that stream and runs
    ema = decay * ema + (1 - decay) * copy with _foreach_mul_ and
    _foreach_add_. step() joins the thread (and the stream) before the next
    optimizer step."""
    name = "NeMo-style CPU copy + thread"
    d2h = True

    def __init__(self, model):
        super().__init__(model)
        self.names = [n for n, _ in model.named_parameters()]
        self.params = list(model.parameters())
        self.emas = tuple(p.data.detach().clone().to("cpu") for p in self.params)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.thread: Optional[threading.Thread] = None
        dtype = str(self.params[0].dtype).replace("torch.", "")
        self.where = f"host ({dtype}), a fresh host copy of the weights each update"

    @staticmethod
    def _ema_update(emas, current, stream):
        if stream is not None:
            stream.synchronize()
        with torch.no_grad():
            torch._foreach_mul_(emas, DECAY)
            torch._foreach_add_(emas, current, alpha=1.0 - DECAY)

    def join(self):
        if self.stream is not None:
            self.stream.synchronize()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def before_step(self):
        self.join()

    def update(self, step):
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                current = tuple(p.data.to("cpu", non_blocking=True) for p in self.params)
        else:
            current = tuple(p.data.to("cpu", non_blocking=True) for p in self.params)
        if self.stream is not None:
            self.last_copy_pinned = current[0].is_pinned()
        self.thread = threading.Thread(target=self._ema_update,
                                       args=(self.emas, current, self.stream))
        self.thread.start()

    def sources_read(self):
        if self.stream is not None:
            self.stream.synchronize()

    def complete(self):
        self.join()

    def ema_of(self, name):
        self.join()
        return self.emas[self.names.index(name)].double()


class Shardema(Method):
    """shardema.EMA with its defaults (float32 EMA in pinned host memory,
    the CUDA copy engine where there is a device): update() after
    optimizer.step(), fence() before the next one."""
    name = "shardema"
    d2h = True

    def __init__(self, model):
        super().__init__(model)
        import shardema
        self.ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY),
                                copy_on_first_update=False)
        self.where = "pinned host (float32)" if self.device.type == "cuda" else "host (float32)"

    def before_step(self):
        self.ema.fence()

    def update(self, step):
        self.ema.update(step)

    def sources_read(self):
        self.ema.fence()
        cuda_sync(self.device)  # with the CUDA engine, fence() is a stream wait

    def complete(self):
        self.ema.fence()
        self.ema.wait()

    def ema_of(self, name):
        self.complete()
        return self.ema.ema_tensors([name])[name].double().cpu()


# The order they run in: no EMA and shardema first, so that a run cut short
# by its budget still has the rows the targets are read from.
ALL = (NoEma, Shardema, TorchtitanOffload, NemoCpuThread, GpuForeach)
