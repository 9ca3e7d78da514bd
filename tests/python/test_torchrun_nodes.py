"""The multi-node recipe (examples/torchrun_nodes.py) under torchrun, on this machine.

Two node processes (``torchrun --nnodes 2 --nproc-per-node 1``, c10d rendezvous on loopback,
Gloo), started concurrently, train the example's model data-parallel (pipelines for its stages,
the gradient and loss all-reduces on worker threads 1 and 2, each on its thread group, on the
asynchronous strict sim device); one node with the same world size (``--nnodes 1
--nproc-per-node 2``) trains it again, and ``--reference`` computes it in one process without
pipelines or torch.distributed. All must end with the same parameters, bit for bit. Each torchrun
is bounded by a timeout (its whole process group is killed), so a hung rendezvous or collective
fails the test instead of hanging it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist

import torch_pipeline as tp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "torchrun_nodes.py")
ARGS = ["--sim-async", "--device", "sim", "--steps", "4"]
TIMEOUT_S = 150.0

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
              pytest.mark.timeout(600)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> Dict[str, str]:
    # The children import the torch_pipeline this test imported (a worktree's, not an install's).
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(tp.__file__)))
    path = os.environ.get("PYTHONPATH")
    # Debug mode on: a process group used from two threads is reported (each rank saves hazards()).
    return dict(os.environ, OMP_NUM_THREADS="1", TORCH_PIPELINE_DEBUG_COLLECTIVES="1",
                PYTHONPATH=package_root + (os.pathsep + path if path else ""))


def run_all(commands: List[List[str]], what: str) -> None:
    """Starts `commands` concurrently; fails unless every one exits 0 within TIMEOUT_S."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=child_env(), start_new_session=True) for c in commands]
    logs: List[str] = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)   # torchrun and the ranks it started
            p.communicate()
        pytest.fail(f"{what}: not finished within {TIMEOUT_S:.0f} s "
                    "(a rendezvous or a collective hung?)")
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"{what}, process {i} exited {p.returncode}:\n{log[-4000:]}"


def torchrun(nnodes: int, nproc: int, port: int, run_id: str, out: str, is_host: bool) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={int(is_host)}", "--local-addr", "127.0.0.1",
            EXAMPLE, *ARGS, "--out", out]


def load(path: str) -> Dict[str, Any]:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def runs() -> Iterator[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        two, one, ref = (os.path.join(tmp, d) for d in ("two_nodes", "one_node", "reference"))
        port, run_id = free_port(), uuid.uuid4().hex
        # The two nodes, concurrently: node 0 hosts the rendezvous store, node 1 joins it.
        run_all([torchrun(2, 1, port, run_id, two, is_host=True),
                 torchrun(2, 1, port, run_id, two, is_host=False)], "two nodes")
        run_all([torchrun(1, 2, free_port(), uuid.uuid4().hex, one, is_host=True)], "one node")
        run_all([[sys.executable, EXAMPLE, "--reference", "--world", "2", *ARGS, "--out", ref]],
                "reference")
        yield {"two": [load(os.path.join(two, f"rank{r}.pt")) for r in range(2)],
               "one": [load(os.path.join(one, f"rank{r}.pt")) for r in range(2)],
               "reference": load(os.path.join(ref, "reference.pt"))}


def test_two_node_processes_each_ran_a_rank(runs: Dict[str, Any]) -> None:
    """Each of the two torchrun agents was a node of its own with one rank; the single-node run
    had both ranks on node 0; every rank trained on sim with Gloo."""
    two, one = runs["two"], runs["one"]
    assert sorted(r["node_rank"] for r in two) == [0, 1]
    assert [r["local_world_size"] for r in two] == [1, 1]
    assert [r["local_rank"] for r in two] == [0, 0]
    assert [r["node_rank"] for r in one] == [0, 0]
    assert sorted(r["local_rank"] for r in one) == [0, 1]
    for r in two + one:
        assert (r["world"], r["device"], r["backend"]) == (2, "sim:0", "gloo")
    assert len({r["pid"] for r in two + one}) == 4


def test_each_worker_thread_issued_collectives_on_its_own_group(runs: Dict[str, Any]) -> None:
    """Debug mode saw no process group used from a second thread: the gradient (worker thread 1)
    and loss (worker thread 2) all-reduces each used their thread group."""
    for r in runs["two"] + runs["one"]:
        assert r["hazards"] == []


def test_two_nodes_end_bit_equal_to_one_node_and_to_the_reference(runs: Dict[str, Any]) -> None:
    """The parameters after training: the same on every rank, bit for bit, whether the two ranks
    ran on two nodes or one, and the same as the single-process reference without pipelines."""
    ref, digest = runs["reference"]["params"], runs["reference"]["checksum"]
    for r in runs["two"] + runs["one"]:
        where = f"rank {r['rank']} on node {r['node_rank']} of {len(runs['two'])} or 1"
        assert len(r["params"]) == len(ref) > 0
        assert all(torch.equal(a, b) for a, b in zip(r["params"], ref)), \
            f"{where}: {r['checksum']} != the reference's {digest}"
        assert r["checksum"] == digest
        assert r["losses"] == runs["reference"]["losses"]


def test_the_training_changed_the_parameters(runs: Dict[str, Any]) -> None:
    """Not vacuous: the steps ran (one loss each) and moved the parameters off their start."""
    r = runs["two"][0]
    assert len(r["losses"]) == 4
    assert r["checksum"] != r["initial_checksum"]
    assert len(r["checksum"]) == 64
