"""The harness every gloo test runs its ranks in (:func:`testlib.run_processes` with :func:`testlib.gloo_group`):
a clean run passes, a rank that raises is the rank reported, not a peer left waiting at the closing barrier, a
rank that returns with a thread still running fails, and a rank whose last reference to its group dies after the
group is destroyed does not deadlock there; a rank that hangs has its native stacks printed."""
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from testlib import free_port, gloo_group, py_spy, run_processes  # noqa: E402

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def summing(rank, port, out_dir):
    with gloo_group(rank, 2, port=port, timeout_s=30):
        total = torch.tensor([rank + 1])
        dist.all_reduce(total)
        torch.save(total, f"{out_dir}/rank{rank}.pt")


def raising_in_rank_1(rank, port):
    with gloo_group(rank, 2, port=port, timeout_s=30):
        if rank == 1:
            raise ValueError("rank 1 fails on purpose")


def leaving_a_thread(rank, port):
    import threading

    with gloo_group(rank, 2, port=port, timeout_s=30):
        stop = threading.Event()
        threading.Thread(target=stop.wait, name="left-running").start()  # never set: a thread a rank forgot


def group_outliving_the_with(rank, port, out_dir):
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    with gloo_group(rank, 2, port=port, timeout_s=30):
        pair = dist.new_group([0, 1])  # its own gloo threads: the closing barrier on the world does not wait on them
        ddp = DDP(torch.nn.Linear(2, 1), process_group=pair)  # its Reducer: the group's last reference, once destroyed
        # the callback runs on one of the pair's gloo threads and takes the GIL back when its sleep ends: a destructor
        # joining that thread with the GIL held waits on it forever
        if rank == 1:
            time.sleep(1)  # rank 0's all-reduce is still waiting when its callback is added: it runs on a gloo thread
        dist.all_reduce(torch.ones(1), group=pair, async_op=True).get_future().then(lambda fut: time.sleep(3))
        del pair
    del ddp  # ~Reducer -> ~ProcessGroupGloo -> join, GIL held (pybind frees a Reducer without releasing it)
    open(f"{out_dir}/rank{rank}.freed", "w").close()  # past the point where the rank hung


def test_a_rank_whose_group_outlives_the_with_does_not_hang(tmp_path):
    """Session 17's stop failed CI on test_prefixtree_ddp.py past its 120 s limit (1 of 40 runs beside two busy
    loops here): the DDP model freed at the worker's return held the destroyed group's last reference; the group's
    destructor joined its gloo threads with the GIL held, while one of them, freeing a finished all-reduce's
    tensor, waited for the GIL (py-spy: ``~Reducer -> ~ProcessGroupGloo -> std::thread::join`` against
    ``~AsyncAllreduceWork -> decref_pyobject -> gil_scoped_acquire``; pytorch#56297). Here the thread waits in a
    future's callback, so the deadlock does not wait on the scheduler (the old harness hung 4 of 4 runs):
    ``gloo_group`` keeps every group it destroyed referenced until the rank leaves by ``os._exit``, so no gloo
    destructor runs in a rank that passed; both ranks get past the freeing, and say so."""
    run_processes(group_outliving_the_with, 2, (free_port(), str(tmp_path)), timeout_s=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.freed", "rank1.freed"]


def test_a_clean_run_passes(tmp_path):
    run_processes(summing, 2, (free_port(), str(tmp_path)), timeout_s=60)
    assert [torch.load(tmp_path / f"rank{r}.pt").item() for r in range(2)] == [3, 3]  # both ranks summed 1 + 2


def test_the_rank_that_raised_is_the_one_reported():
    """Rank 0 leaves the body cleanly and waits at the barrier; rank 1 raises and destroys its group, so rank 0's
    barrier fails too ("Connection closed by peer"): the report must be rank 1's error, not rank 0's."""
    with pytest.raises(Exception, match="rank 1 fails on purpose") as raised:
        run_processes(raising_in_rank_1, 2, (free_port(),), timeout_s=60)
    assert "Process 1 terminated" in str(raised.value)


def test_a_rank_that_leaves_a_thread_running_fails(capfd):
    """Ranks leave by ``os._exit`` (past the interpreter's teardown): a non-daemon thread still running, which
    the teardown would have waited on forever, fails the rank, named, instead of passing unseen."""
    with pytest.raises(Exception, match="exit code 1"):
        run_processes(leaving_a_thread, 2, (free_port(),), timeout_s=60)
    assert "returned with threads still running: ['left-running']" in capfd.readouterr().err


def sleeping(rank):
    import time

    time.sleep(120)  # past any limit: a rank that hangs


def test_a_rank_past_the_limit_has_its_native_stacks_printed(capfd):
    """A hang fails the test and says where, native frames included (py-spy, the test extra): the deadlock above
    sat in a C++ destructor, where faulthandler's Python stacks showed nothing."""
    if not py_spy():
        pytest.skip("py-spy is not installed (pip install -e .[test])")
    with pytest.raises(pytest.fail.Exception, match="did not finish in 12 s"):
        run_processes(sleeping, 1, (), timeout_s=12)
    err = capfd.readouterr().err
    if "Permission" in err or "ptrace" in err:  # where attaching is not allowed (Yama, a container without SYS_PTRACE)
        pytest.skip("py-spy may not attach to another process here")
    assert "Thread" in err and "sleeping (test_testlib_ranks.py" in err, err[-2000:]
