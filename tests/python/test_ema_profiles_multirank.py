"""Several profiles of one EMA of a fully_shard (FSDP2) model on 2 ranks:
profiles_worker.py checks each profile against its own EMA object and a
float64 recomputation, and the export, checkpoint and DCP round trips of
every profile, on every rank."""
import rank_launch


def test_fsdp2_profiles_gather_export_and_resume(tmp_path):
    ranks = rank_launch.launch("profiles_worker.py", "fsdp2", 2, tmp_path, timeout=240)
    assert ranks.codes == [0, 0], ranks.errors
