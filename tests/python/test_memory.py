"""Memory stays flat over many Pipeline lifetimes and tasks; slots are reused (docs/design.md,
"Concepts": pipelines whose lifetimes do not overlap get the same slot, smallest free first)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest

import torch_pipeline as tp

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)"
)

MiB = 1 << 20
MAX_GROWTH = 8 * MiB
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_SIZE


def create_enter_exit(iterations: int) -> int:
    """``iterations`` times: a Pipeline entered with ``with p:`` and one entered through
    ``tp.pipeline(...)``, each dropped afterwards; returns the largest slot id seen."""
    max_id = 0
    for _ in range(iterations):
        p = tp.Pipeline()
        with p:
            pass
        max_id = max(max_id, p.id)
        del p
        with tp.pipeline(tp.Pipeline()) as q:
            max_id = max(max_id, q.id)
        del q
    return max_id


def test_create_enter_exit_memory_is_flat_and_slots_are_reused() -> None:
    """2e5 create/enter/exit rounds after a 2e4 warm-up: RSS grows < 8 MiB and the slot ids
    never climb (the first free slot is reused every time)."""
    gc.collect()  # pipelines kept only by garbage (e.g. old tracebacks) give their slots back
    first, second = tp.Pipeline(), tp.Pipeline()
    free_ids = {first.id, second.id}  # the two smallest free slots: {1, 2} in a fresh process
    del first, second
    assert tp.current_pipeline() == tp.default_pipeline()

    warm_max = create_enter_exit(20_000)
    before = rss_bytes()
    full_max = create_enter_exit(200_000)
    growth = rss_bytes() - before

    assert growth < MAX_GROWTH, f"RSS grew by {growth / MiB:.1f} MiB"
    # Each round's pipelines are released before the next round's are made, so only the smallest
    # free slot (and the next one, while the previous round's q is still bound) is ever used.
    assert full_max <= max(free_ids) and warm_max <= max(free_ids), (free_ids, warm_max, full_max)
    assert tp.current_pipeline() == tp.default_pipeline()


def test_fresh_process_slot_ids_are_one_or_two() -> None:
    """In a fresh interpreter the create/enter/exit loop only ever uses slot ids 1 and 2."""
    source = textwrap.dedent(
        """
        import torch_pipeline as tp
        max_id = 0
        for _ in range(2000):
            p = tp.Pipeline()
            with p:
                pass
            max_id = max(max_id, p.id)
            del p
            with tp.pipeline(tp.Pipeline()) as q:
                max_id = max(max_id, q.id)
            # q stays bound here on purpose: the next round's p takes the next slot
        print("MAX", max_id)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_PIPELINE_")}
    proc = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["MAX", "2"]


def submit_wait(pipeline: tp.Pipeline, iterations: int) -> None:
    for i in range(iterations):
        value = pipeline.submit(divmod, i, 7).wait()
        assert value == divmod(i, 7)


def test_submit_wait_memory_is_flat() -> None:
    """2e4 submit/wait cycles after a 2e3 warm-up: RSS grows < 8 MiB (tasks, futures and their
    references are released)."""
    p = tp.Pipeline(1)
    submit_wait(p, 2_000)
    before = rss_bytes()
    submit_wait(p, 20_000)
    growth = rss_bytes() - before
    assert growth < MAX_GROWTH, f"RSS grew by {growth / MiB:.1f} MiB"
    assert p.query()


def test_submitted_arguments_are_released_after_the_task() -> None:
    """A task's function and arguments are dropped once it ran: nothing keeps them alive."""
    class Payload:
        pass

    p = tp.Pipeline()
    payload = Payload()
    ref = weakref.ref(payload)
    fut = p.submit(lambda x: None, payload)
    fut.wait()
    del payload, fut
    gc.collect()
    assert ref() is None
