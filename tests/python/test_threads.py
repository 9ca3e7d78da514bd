"""Several Python threads launching at once, on the sim device in strict mode.

Every thread of a process shares each device's default stream, and threads may share pipelines,
so the tracker sees ops of several threads on one stream at the same time: positions handed out in
one order can reach the stream in another. Each program below raised ``sim.RaceError`` within
seconds before the tracker accounted for that (an event taken as covering a position that another
thread was still launching). Each runs clean and computes the right values with tracking on, and
races with tracking off (the untracked twin). Then a randomized storm: 16 threads, shared and
private pipelines, two devices, each thread's results equal to a serial replay of its program.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import random
import threading
from typing import Callable, List, Optional, Sequence

import torch

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures, untracked

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from _programs import make_program, run_program


_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


def run_threads(count: int, body: Callable[[int], None]) -> List[BaseException]:
    """Runs body(0..count-1) on `count` threads started together; returns what they raised."""
    errors: List[BaseException] = []
    start = threading.Barrier(count)

    def main(i: int) -> None:
        try:
            start.wait()
            body(i)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=main, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread did not finish (deadlock?)"
    return errors


def check_clean(errors: Sequence[BaseException]) -> None:
    assert not errors, f"{len(errors)} thread(s) failed; first: {errors[0]!r}"
    assert sim.races() == []


# ---- the default stream, shared by threads with private pipelines ---------------------------------
def private_pipelines(iterations: int) -> Callable[[int], None]:
    def body(i: int) -> None:
        p = tp.Pipeline(i % tp.max_worker_threads())
        a = torch.full((1024,), float(i + 1), device="sim:0")
        expected = torch.sin(torch.full((1024,), 2.0 * (i + 1)))
        for k in range(iterations):
            x = a + a                      # the default stream, shared by every thread
            with tp.pipeline(p):
                y = torch.sin(x)           # p's stream: waits for this thread's add
            if k % 500 == 0:
                assert torch.equal(y.cpu(), expected)
    return body


def test_threads_with_private_pipelines_on_the_shared_default_stream() -> None:
    check_clean(run_threads(4, private_pipelines(3000)))
    with untracked():
        run_threads(4, private_pipelines(200))
        assert sim.races(), "untracked, the threads' reads on their pipelines must race"


# ---- four threads sharing four pipelines -----------------------------------------------------------
def shared_pipelines(pipelines: Sequence["tp.Pipeline"], iterations: int) -> Callable[[int], None]:
    def body(i: int) -> None:
        a = torch.full((1024,), float(i), device="sim:0")
        expected = torch.sin(torch.full((1024,), 2.0 * (i + 1)))
        rng = random.Random(i)
        for _ in range(iterations):
            p, q = rng.sample(list(pipelines), 2)
            with tp.pipeline(p):
                x = a + 1
            with tp.pipeline(q):
                x.mul_(2)                  # write after write: q waits for p
            with tp.pipeline(p):
                y = torch.sin(x)           # read after write: p waits for q
        assert torch.equal(y.cpu(), expected)
    return body


def test_threads_sharing_pipelines() -> None:
    pipelines = [tp.Pipeline(w % 2) for w in range(4)]
    check_clean(run_threads(4, shared_pipelines(pipelines, 1500)))
    with untracked():
        run_threads(4, shared_pipelines(pipelines, 100))
        assert sim.races()


# ---- host reads of non_blocking copies, one pipeline shared by two threads -------------------------
def host_reads(p: "tp.Pipeline", iterations: int) -> Callable[[int], None]:
    def body(i: int) -> None:
        a = torch.full((4096,), float(i + 1), device="sim:0")
        for _ in range(iterations):
            with tp.pipeline(p):
                h = (a + a).to("cpu", non_blocking=True)
            assert h.sum().item() == 4096 * 2.0 * (i + 1)  # a CPU read: waits for the copy
    return body


def test_threads_reading_their_non_blocking_copies_on_the_host() -> None:
    p = tp.Pipeline()
    check_clean(run_threads(2, host_reads(p, 1500)))
    with untracked():
        run_threads(2, host_reads(p, 50))
        assert sim.races()


# ---- backward on two devices from several threads ---------------------------------------------------
def two_device_training(iterations: int) -> Callable[[int], None]:
    def body(i: int) -> None:
        torch.manual_seed(i)
        stage0 = torch.nn.Linear(64, 64).to("sim:0")
        stage1 = torch.nn.Linear(64, 8).to("sim:1")
        p0, p1 = tp.Pipeline(i % 2), tp.Pipeline(i % 2)
        opt = torch.optim.SGD(list(stage0.parameters()) + list(stage1.parameters()), lr=0.01)
        x = torch.randn(16, 64, device="sim:0")
        for _ in range(iterations):
            with tp.pipeline(p0):
                h = torch.relu(stage0(x))
            with tp.pipeline(p1):
                loss = stage1(h.to("sim:1")).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return body


def test_threads_training_across_two_devices() -> None:
    check_clean(run_threads(8, two_device_training(40)))


# ---- the storm: 16 threads, random programs, equal to a serial replay ------------------------------
def test_storm_of_random_programs_equals_serial_replay() -> None:
    rng = random.Random(2024)
    shared = [tp.Pipeline(w % 2) for w in range(4)]
    threads = 16
    programs = [make_program(rng, length=20) for _ in range(threads * 3)]
    choices = [[rng.randrange(4) for _ in range(3)] for _ in range(len(programs))]

    def pipelines_for(n: int, private: "tp.Pipeline") -> List[Optional["tp.Pipeline"]]:
        a, b, c = choices[n]
        return [None, shared[a], private, shared[b] if c else None]

    expected = [run_program(prog, [None] * 4, n, ["sim:0", "sim:1"])
                for n, prog in enumerate(programs)]
    got: List[Optional[List[torch.Tensor]]] = [None] * len(programs)

    def body(i: int) -> None:
        private = tp.Pipeline(i % tp.max_worker_threads())
        for n in range(i, len(programs), threads):
            got[n] = run_program(programs[n], pipelines_for(n, private), n, ["sim:0", "sim:1"])

    check_clean(run_threads(threads, body))
    for n, (want, have) in enumerate(zip(expected, got)):
        assert have is not None and len(have) == len(want)
        for w, h in zip(want, have):
            assert torch.equal(w, h), f"program {n} computed other values under the storm"


install_proxies(globals(), __file__)
