"""The harness every gloo test runs its ranks in (:func:`testlib.run_processes` with :func:`testlib.gloo_group`):
a clean run passes, and a rank that raises is the rank reported, not a peer left waiting at the closing barrier."""
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from testlib import free_port, gloo_group, run_processes  # noqa: E402

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def summing(rank, port):
    with gloo_group(rank, 2, port=port, timeout_s=30):
        total = torch.tensor([rank + 1])
        dist.all_reduce(total)
        assert total.item() == 3, total


def raising_in_rank_1(rank, port):
    with gloo_group(rank, 2, port=port, timeout_s=30):
        if rank == 1:
            raise ValueError("rank 1 fails on purpose")


def test_a_clean_run_passes():
    run_processes(summing, 2, (free_port(),), timeout_s=60)


def test_the_rank_that_raised_is_the_one_reported():
    """Rank 0 leaves the body cleanly and waits at the barrier; rank 1 raises and destroys its group, so rank 0's
    barrier fails too ("Connection closed by peer"): the report must be rank 1's error, not rank 0's."""
    with pytest.raises(Exception, match="rank 1 fails on purpose") as raised:
        run_processes(raising_in_rank_1, 2, (free_port(),), timeout_s=60)
    assert "Process 1 terminated" in str(raised.value)
