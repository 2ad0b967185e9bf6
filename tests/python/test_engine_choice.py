"""Which copy engine an EMA gets, and what it says about it: engine="auto"
on a machine without a GPU takes the host engine without a word (there is
nothing wrong to report); engine="cuda" where no device can be used is an
error that says why. Each case runs in a fresh interpreter: the device
probe runs once per process, so an earlier test of this process would
have used up its one chance to warn."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import python_for_workers


def _fresh(code: str) -> dict:
    """Runs `code` in a new interpreter with this one's shardema; returns
    the JSON it prints last."""
    result = subprocess.run([python_for_workers(), "-c", textwrap.dedent(code)],
                            capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")


@no_gpu
def test_auto_engine_without_a_gpu_is_silent():
    out = _fresh("""
        import json, warnings
        import torch, shardema
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = torch.nn.Linear(4, 4)
            ema = shardema.EMA(model)
            ema.update()
            ema.wait()
            shardema.EMA(model, engine="auto")
        print(json.dumps([str(w.message) for w in caught]))
    """)
    assert out == []


@no_gpu
def test_nothing_reaches_stderr_either():
    result = subprocess.run(
        [python_for_workers(), "-c",
         "import torch, shardema; shardema.EMA(torch.nn.Linear(4, 4)).update()"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert "CUDA" not in result.stderr, result.stderr


@no_gpu
def test_explicit_cuda_engine_says_why_it_cannot_be_used():
    out = _fresh("""
        import json
        import torch, shardema
        try:
            shardema.EMA(torch.nn.Linear(4, 4), engine="cuda")
            print(json.dumps(None))
        except RuntimeError as error:
            print(json.dumps(str(error)))
    """)
    assert out is not None, "engine='cuda' without a usable device must be refused"
    assert "no usable CUDA device" in out
    # The reason itself, not only the verdict: this machine has no driver
    # (or a driver without devices), or was built without CUDA.
    assert any(why in out for why in ("no NVIDIA driver", "no CUDA device present",
                                      "built without CUDA", "update the driver")), out
    assert "\n" not in out.strip()
