"""shardema's EMACallback against the VersatIL seed's behaviour under DDP,
where the ranks' BatchNorm statistics differ: a real Lightning Trainer on 2
CPU processes (Gloo), accumulate_grad_batches=3, a BatchNorm, a frozen
layer (lightning_buffers_worker.py runs it with each callback from the
same seed). The seed keeps, on every rank, a deep copy updated from that
rank's own tensors: each rank's EMA of a buffer is its own buffer, the
checkpoint (written by rank 0) holds rank 0's, and validation runs each
rank's copy (DDP then broadcasts rank 0's buffers at the first forward).
shardema must give the same numbers, to float32 rounding."""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import rank_launch  # noqa: E402

WORLD = 2


def close(got, want, what):
    if not want.is_floating_point():
        assert torch.equal(got, want), what
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


def test_ddp_batchnorm_ema_matches_the_seed_on_every_rank(tmp_path):
    ranks = rank_launch.launch("lightning_buffers_worker.py", ["ours", "seed"], WORLD, tmp_path,
                               timeout=240, torchrun=True)
    assert ranks.errors == {} and ranks.codes == [0] * WORLD, (ranks.codes, ranks.errors)
    runs = {name: [torch.load(tmp_path / f"{name}.rank{r}.pt") for r in range(WORLD)]
            for name in ("ours", "seed")}
    ours, seed = runs["ours"], runs["seed"]
    for r in range(WORLD):
        # The same training in both runs: the EMA never touches the raw weights.
        assert ours[r]["global_step"] == seed[r]["global_step"] == 4
        for k, v in seed[r]["raw"].items():
            assert torch.equal(ours[r]["raw"][k], v), f"rank {r}: raw '{k}'"
    # What the test stands on: the ranks' statistics differ by far more
    # than the tolerance, in the raw model and in the seed's EMA.
    for state in (seed[0]["raw"], seed[1]["raw"], seed[0]["emas"][-1], seed[1]["emas"][-1]):
        assert "norm.running_mean" in state
    gap = (seed[0]["emas"][-1]["norm.running_mean"] - seed[1]["emas"][-1]["norm.running_mean"])
    assert gap.abs().max() > 0.1, gap
    for r in range(WORLD):
        # Each rank's EMA, at each validation start: its own buffers, the
        # average of the (equal) trainable weights, the frozen and BatchNorm
        # parameters copied.
        assert len(ours[r]["emas"]) == len(seed[r]["emas"]) == 2
        for i, (got, want) in enumerate(zip(ours[r]["emas"], seed[r]["emas"])):
            assert sorted(got) == sorted(want), (sorted(got), sorted(want))
            for k in want:
                close(got[k], want[k], f"rank {r}, validation {i}: EMA '{k}'")
        # Validation forwards of the EMA on each rank's own data.
        assert len(ours[r]["outputs"]) == len(seed[r]["outputs"]) == 2
        for i, (got, want) in enumerate(zip(ours[r]["outputs"], seed[r]["outputs"])):
            close(got, want, f"rank {r}, validation {i}: outputs")
    # The checkpoints rank 0 wrote: rank 0's EMA in the state_dict, the raw
    # weights under raw_policy_state_dict.
    for epoch in range(2):
        got, want = (torch.load(tmp_path / name / f"epoch={epoch}.ckpt", weights_only=False)
                     for name in ("ours", "seed"))
        policy = sorted(k for k in want["state_dict"] if k.startswith("policy."))
        assert policy == sorted(k for k in got["state_dict"] if k.startswith("policy."))
        for k in policy:
            close(got["state_dict"][k], want["state_dict"][k], f"epoch {epoch}: EMA '{k}'")
        raw_want = want["raw_policy_state_dict"]
        assert sorted(got["raw_policy_state_dict"]) == sorted(raw_want)
        for k, v in raw_want.items():
            assert torch.equal(got["raw_policy_state_dict"][k], v), f"epoch {epoch}: raw '{k}'"
