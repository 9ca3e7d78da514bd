"""Every public entry point of ``torch.accelerator`` and of ``torch.sim`` (torch_pipeline.sim, the
device module PyTorch finds for "sim") called with sim enabled, in synchronous and in asynchronous
mode: each returns what it should or raises a clear Python exception, and none crashes the process
(``torch.accelerator.empty_host_cache()`` once died of a segmentation fault: no host allocator was
registered for sim).

The calls run in child processes, each from a fresh state (device 0, its default stream, the host
synchronized, a sim tensor made through a Python factory so that PyTorch counts the device as
initialized, and a pinned block freed). A child that dies is charged to the entry point it was in,
and a new child carries on with the next one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import pytest
import torch

import torch_pipeline.sim

# What each entry point runs (`x` is a sim tensor of 8 ones on sim:0); statements that must hold
# are asserts. An entry point that is not supported on sim is in REFUSED instead.
CALLS: Dict[str, str] = {
    # torch.accelerator
    "accelerator.current_accelerator":
        "assert torch.accelerator.current_accelerator(True) == torch.device('sim')",
    "accelerator.current_device_index": "assert torch.accelerator.current_device_index() == 0",
    "accelerator.current_device_idx": "assert torch.accelerator.current_device_idx() == 0",
    "accelerator.current_stream":
        "assert torch.accelerator.current_stream(1).device == torch.device('sim:1')",
    "accelerator.device_count": "assert torch.accelerator.device_count() == 2",
    "accelerator.device_index":
        "with torch.accelerator.device_index(1):\n"
        "    assert torch.accelerator.current_device_index() == 1\n"
        "assert torch.accelerator.current_device_index() == 0",
    "accelerator.empty_cache":  # as CUDA's: the cached blocks go back (after a synchronize)
        "del x\nbefore = torch.accelerator.memory_reserved()\n"
        "free_before = torch.accelerator.get_memory_info()[0]\n"
        "y = torch.ones(1 << 20, device='sim:0')\nsize = torch.accelerator.memory_reserved() - before\n"
        "s = torch.Stream()\ns.wait_stream(torch.accelerator.current_stream())\n"
        "with s:\n    z = y * 2\n"
        "del y, z\ntorch.accelerator.empty_cache()\n"
        "assert size >= 4 << 20 and torch.accelerator.memory_reserved() <= before\n"
        "assert torch.accelerator.get_memory_info()[0] >= free_before\n"
        "w = torch.zeros(1 << 20, device='sim:0')\n"  # new memory after a synchronize: no race
        "assert torch.sim.races() == []",
    "accelerator.empty_host_cache":
        "torch.accelerator.empty_host_cache()\n"
        "assert torch.sim.host_memory_stats()['allocations.current'] == 0\n"
        "p = torch.ones(100).pin_memory()\n"
        "torch.accelerator.empty_host_cache()\n"
        "assert p.is_pinned() and p.sum().item() == 100",
    "accelerator.get_device_capability":  # as PyTorch's test_device_capability_supported_dtypes
        "caps = torch.accelerator.get_device_capability()['supported_dtypes']\n"
        "assert torch.float32 in caps and torch.qint8 not in caps\n"
        "for dt in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:\n"
        "    try:\n"
        "        torch.empty(16, dtype=dt, device='sim').to(torch.float32).to(dt)\n"
        "        torch.sim.synchronize()\n"  # (asynchronous mode: a kernel's error comes here)
        "        assert dt in caps, dt\n"
        "    except (RuntimeError, TypeError):\n"
        "        assert dt not in caps, dt",
    "accelerator.get_memory_info":
        "free, total = torch.accelerator.get_memory_info(1)\nassert 0 <= free <= total",
    "accelerator.is_available": "assert torch.accelerator.is_available()",
    "accelerator.max_memory_allocated": "assert torch.accelerator.max_memory_allocated() >= 32",
    "accelerator.max_memory_reserved": "assert torch.accelerator.max_memory_reserved() >= 32",
    "accelerator.memory_allocated": "assert torch.accelerator.memory_allocated() >= 32",
    "accelerator.memory_reserved": "assert torch.accelerator.memory_reserved() >= 32",
    "accelerator.memory_stats":
        "assert torch.accelerator.memory_stats()['allocated_bytes.all.current'] >= 32",
    "accelerator.reset_accumulated_memory_stats":
        "torch.accelerator.reset_accumulated_memory_stats()\n"
        "assert torch.accelerator.memory_stats()['allocated_bytes.all.allocated'] == 0",
    "accelerator.reset_peak_memory_stats":
        "torch.accelerator.reset_peak_memory_stats()\n"
        "assert torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated()",
    "accelerator.set_device_idx":
        "torch.accelerator.set_device_idx(1)\nassert torch.accelerator.current_device_index() == 1",
    "accelerator.set_device_index":
        "torch.accelerator.set_device_index(1)\n"
        "assert torch.accelerator.current_device_index() == 1",
    "accelerator.set_stream":
        "s = torch.Stream(device='sim:1')\ntorch.accelerator.set_stream(s)\n"
        "assert torch.accelerator.current_stream(1) == s",
    "accelerator.synchronize":
        "y = x * 2\ntorch.accelerator.synchronize()\ntorch.accelerator.synchronize(1)\n"
        "assert y.sum().item() == 16",
    # torch.sim: the device module
    "sim.module": "assert torch.sim is sim and torch.get_device_module('sim') is sim",
    "sim.is_available": "assert torch.sim.is_available() and torch.sim.is_initialized()",
    "sim._lazy_init": "torch.sim._lazy_init()\nassert not torch.sim._is_in_bad_fork()",
    "sim.is_enabled": "assert torch.sim.is_enabled()",
    "sim.enable": "torch.sim.enable(2)\nassert torch.sim.device_count() == 2",
    "sim.device_count": "assert torch.sim.device_count() == 2",
    "sim.current_device": "assert torch.sim.current_device() == 0",
    "sim.set_device": "torch.sim.set_device('sim:1')\nassert torch.sim.current_device() == 1",
    "sim.device":
        "with torch.sim.device(1):\n    assert torch.sim.current_device() == 1\n"
        "assert torch.sim.current_device() == 0",
    "sim.current_stream": "assert torch.sim.current_stream('sim:1').device_index == 1",
    "sim.set_stream":
        "s = torch.Stream(device='sim:0')\ntorch.sim.set_stream(s)\n"
        "assert torch.sim.current_stream() == s",
    "sim.synchronize": "y = x + 1\ntorch.sim.synchronize()\ntorch.sim.synchronize('sim:1')",
    "sim.get_amp_supported_dtype": "assert torch.bfloat16 in torch.sim.get_amp_supported_dtype()",
    "sim.rng_state":
        "st = torch.sim.get_rng_state()\na = torch.rand(3, device='sim')\n"
        "torch.sim.set_rng_state(st)\nassert torch.equal(a, torch.rand(3, device='sim'))",
    "sim.manual_seed":  # (it once did nothing)
        "torch.sim.manual_seed(3)\na = torch.rand(3, device='sim')\n"
        "torch.sim.manual_seed_all(3)\nassert torch.equal(a, torch.rand(3, device='sim'))\n"
        "torch.manual_seed(3)\nassert torch.equal(a, torch.rand(3, device='sim'))",
    "sim.raw_kernel": "torch.sim.raw_kernel('k', read=[x], write=[x])\nassert torch.sim.races() == []",
    "sim.races": "assert torch.sim.races() == []\ntorch.sim.clear_races()",
    "sim.default_stream":
        "assert torch.sim.default_stream(1).stream_id == 0\n"
        "assert torch.sim.default_stream() == torch.sim.current_stream()",
    "sim.init": "torch.sim.init()",
    "sim.DeviceIndexError":
        "try:\n    torch.sim.set_device(7)\nexcept RuntimeError as e:\n"
        "    assert isinstance(e, torch.sim.DeviceIndexError) and isinstance(e, ValueError)\n"
        "else:\n    raise AssertionError('no error')",
    "sim.report_stacks":
        "torch.sim.set_report_stacks(True)\nassert torch.sim.report_stacks()\n"
        "x.add_(1)\ns = torch.Stream(device='sim:0')\nwith s:\n    y = x * 2\n"
        "race = torch.sim.races()[0]\nassert race.later_stack and race.earlier_stack\n"
        "assert 'race 1 of 1' in torch.sim.report()\n"
        "assert torch.sim.group_races(torch.sim.races())[0].count == 1\n"
        "torch.sim.clear_races()\ntorch.sim.set_report_stacks(False)",
    "sim.as_cuda":
        "with torch.sim.as_cuda(devices=2):\n    assert torch.ones(1, device='cuda').is_cuda\n"
        "assert torch.ones(1).to('sim:1').device.type == 'sim'",
    "sim.strict": "torch.sim.set_strict(True)\nassert torch.sim.is_strict()",
    "sim.latency":
        "torch.sim.set_latency(launch_us=1.0)\nassert torch.sim.latency() == (1.0, 0.0)\n"
        "torch.sim.set_latency(op='aten::mul.Tensor', us=5)\ntorch.sim.clear_latency()\n"
        "assert torch.sim.latency() == (0.0, 0.0)",
    "sim.asynchronous":
        "a = torch.sim.is_asynchronous()\ntorch.sim.set_asynchronous(not a)\n"
        "assert torch.sim.is_asynchronous() != a\ntorch.sim.set_asynchronous(a)",
    "sim.host_memory_stats":
        "p = torch.empty(100, pin_memory=True)\n"
        "assert torch.sim.host_memory_stats()['active_requests.current'] == 1",
    "sim.trace":
        "import tempfile, os\npath = os.path.join(tempfile.mkdtemp(), 't.json')\n"
        "with torch.sim.trace(path):\n    y = x * 2\ntorch.sim.synchronize()\n"
        "assert os.path.getsize(path) > 0",
    "sim.graph":
        "g = torch.sim.Graph()\nwith torch.sim.graph(g):\n    x.add_(1)\ng.replay()\n"
        "torch.sim.synchronize()\nassert x.sum().item() == 16",
    # what PyTorch's generic code reaches through the device module and the hooks
    "sim.streams_and_events":
        "s = torch.Stream()\ne1 = torch.Event(enable_timing=True)\n"
        "e2 = torch.Event(enable_timing=True)\ne1.record(s)\nwith s:\n    y = x * 2\n"
        "e2.record(s)\ne2.synchronize()\nassert e1.query() and s.query()\n"
        "assert e1.elapsed_time(e2) >= 0\ns.wait_event(e1)\ns.wait_stream(torch.Stream())",
    "sim.tensor_methods":
        "assert x.is_sim and torch.ones(2).sim(1).device == torch.device('sim:1')\n"
        "assert x.untyped_storage().is_sim",
    "sim.pin_memory":
        "p = torch.ones(4).pin_memory()\nq = x.to('cpu', non_blocking=True)\n"
        "torch.sim.synchronize()\nassert p.is_pinned() and q.is_pinned() and q.sum().item() == 8",
    "sim.record_stream":
        "s = torch.Stream()\nx.record_stream(s)\ndel x\ntorch.accelerator.empty_cache()",
}

# Entry points that sim does not support: (exception type, what the message says).
REFUSED: Dict[str, Tuple[type, str]] = {
    # PyTorch's graphs are CUDA's; the sim's capture twin is torch.sim.Graph.
    "accelerator.Graph": (RuntimeError, "Graph is not supported on device type: sim"),
}
CALLS["accelerator.Graph"] = (
    "g = torch.accelerator.Graph()\nwith torch.Stream(), g:\n    x.add_(1)")

CALLS["sim.empty_host_cache"] = (
    "p = torch.ones(100).pin_memory()\ndel p\ntorch.sim.empty_host_cache()\n"
    "assert torch.sim.host_memory_stats()['allocations.current'] == 0")
# Entry points this torch does not have (torch.accelerator grows between releases: torch 2.11 has
# neither empty_host_cache nor Graph) are not called.
for _name in [n for n in CALLS if n.startswith("accelerator.")]:
    if not hasattr(torch.accelerator, _name.split(".", 1)[1]):
        del CALLS[_name]

_CHILD = r"""
import json, sys, traceback
import torch
import torch_pipeline.sim as sim

sim.enable(2, asynchronous=sys.argv[1] == "1")
calls = json.loads(sys.argv[2])
defaults = [torch.accelerator.current_stream(d) for d in (1, 0)]
for name, code in calls:
    for s in defaults:
        torch.accelerator.set_stream(s)  # (device 0 last: the current device)
    sim.set_strict(False)
    sim.set_asynchronous(sys.argv[1] == "1")
    sim.clear_latency()
    x = torch.ones(8, device="sim")             # through a Python factory: the device is initialized
    h = torch.empty(64, pin_memory=True)        # a pinned block, freed (cached) once copied
    x.copy_(h[:8].fill_(1), non_blocking=True)
    del h
    sim.synchronize(0)
    sim.synchronize(1)
    sim.clear_races()
    print("BEGIN " + name, flush=True)
    try:
        exec(code, {"torch": torch, "sim": sim, "x": x})
        result = ["ok", ""]
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = [type(e).__name__, str(e).splitlines()[0] if str(e) else ""]
    print("END " + json.dumps([name] + result), flush=True)
"""


def _run_all(asynchronous: bool) -> Dict[str, Tuple[str, str]]:
    """name -> (outcome, message): "ok", an exception's type name, or "crash" (with the exit code)."""
    pending: List[Tuple[str, str]] = sorted(CALLS.items())
    results: Dict[str, Tuple[str, str]] = {}
    while pending:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, "1" if asynchronous else "0", json.dumps(pending)],
            capture_output=True, text=True, timeout=240, env=dict(os.environ))
        current: Optional[str] = None
        for line in proc.stdout.splitlines():
            if line.startswith("BEGIN "):
                current = line[len("BEGIN "):]
            elif line.startswith("END "):
                name, outcome, message = json.loads(line[len("END "):])
                results[name] = (outcome, message)
                current = None
        done = set(results)
        if proc.returncode != 0:
            if current is None:  # died outside any call: report it on the next one
                current = next(n for n, _ in pending if n not in done)
            results[current] = ("crash", f"exit code {proc.returncode}: {proc.stderr[-2000:]}")
            done.add(current)
        pending = [(n, c) for n, c in pending if n not in done]
    return results


def _public(module: object) -> List[str]:
    return sorted(n for n in getattr(module, "__all__") if not n.startswith("_"))


def test_every_public_entry_point_has_a_call() -> None:
    """A new public function of torch.accelerator or torch_pipeline.sim gets a call here."""
    names = set(CALLS)
    missing = [f"accelerator.{n}" for n in _public(torch.accelerator)
               if f"accelerator.{n}" not in names]
    covered_by = {"clear_races": "races", "is_strict": "strict", "set_strict": "strict",
                  "clear_latency": "latency", "set_latency": "latency",
                  "is_asynchronous": "asynchronous", "set_asynchronous": "asynchronous",
                  "Graph": "graph", "Race": "races", "RaceError": "strict",
                  "set_report_stacks": "report_stacks", "report": "report_stacks",
                  "group_races": "report_stacks", "RaceReport": "report_stacks"}
    missing += [f"sim.{n}" for n in _public(torch_pipeline.sim)
                if f"sim.{covered_by.get(n, n)}" not in names]
    assert missing == []


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_entry_points_return_or_raise_clearly_never_crash(asynchronous: bool) -> None:
    results = _run_all(asynchronous)
    crashed = {n: m for n, (o, m) in results.items() if o == "crash"}
    assert crashed == {}
    wrong = {}
    for name, (outcome, message) in results.items():
        if name in REFUSED:
            kind, text = REFUSED[name]
            if outcome != kind.__name__ or text not in message:
                wrong[name] = (outcome, message)
        elif outcome != "ok":
            wrong[name] = (outcome, message)
    assert wrong == {}
    assert set(results) == set(CALLS)
