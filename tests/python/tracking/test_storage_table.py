"""The storages part (``StorageTable``, csrc/core/storage_table.h, keyed by c10 storages): fresh
outputs wait in a ring of young storages without an entry while only their own stream uses them;
another stream's use promotes one to an entry; entries of storages that died are swept, so the
table stays within a constant of the storages alive however long the period runs, and the core
tracker forgets what a sweep drops.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import torch

from _parts import part
from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim

N = 256
YOUNG = 64        # StorageTable::kYoung
MIN_SWEEP = 1024  # StorageTable::kMinSweep

_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=1)


def test_outputs_used_only_on_their_stream_get_no_entry() -> None:
    p = tp.Pipeline()
    with tp.pipeline(p):
        x = torch.ones(N, device="sim:0")
        for _ in range(500):
            x = x * 1.5 + 1            # each output young, used on p's stream only, then freed
    storages = part("storages")
    assert storages["entries"] == 0 and 0 < storages["young"] <= YOUNG
    assert part("tracker")["storages"] == 0      # nothing told to the core tracker yet


def test_another_streams_use_promotes_a_young_storage_to_an_entry() -> None:
    p = tp.Pipeline()
    with tp.pipeline(p):
        y = torch.ones(N, device="sim:0") * 2    # young, on p's stream
    before = part("storages")["entries"]
    z = y + 1                                    # the default stream reads it
    assert part("storages")["entries"] == before + 1
    assert part("tracker")["storages"] >= 1      # its state (writer, readers) now in the tracker
    assert torch.equal(z.cpu(), torch.full((N,), 3.0))


def test_entries_stay_bounded_over_a_long_live_period() -> None:
    """Each iteration makes a storage on p's stream, uses it on the default stream (an entry) and
    drops it. The entries must stay within a constant of the live storages (a sweep that kept one
    entry used to stop all later sweeps: ~19,000 entries), and the core tracker forgets the
    storages a sweep drops."""
    p = tp.Pipeline()
    x = torch.ones(N, device="sim:0")
    most = most_tracked = 0
    for i in range(20_000):
        with tp.pipeline(p):
            y = x * 2
        z = y + 1
        del y, z
        if i % 1000 == 999:
            most = max(most, part("storages")["entries"])
            most_tracked = max(most_tracked, part("tracker")["storages"])
    bound = 2 * MIN_SWEEP + YOUNG + 16
    assert most <= bound, f"{most} storage entries for a handful of storages alive"
    assert most_tracked <= bound, f"{most_tracked} storages in the core tracker"
    assert part("storages")["sweeps"] >= 10
    assert sim.races() == []
    del p


install_proxies(globals(), __file__)
