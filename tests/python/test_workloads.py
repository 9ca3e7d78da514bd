"""Real models and training code, run under pipelines on the sim device in strict mode.

Each workload is written the way users write it (nothing here synchronizes by hand) and runs
twice: with every pipeline the default one (the reference) and with its pipelines. The pipelined
run must be race-free (strict mode raises sim.RaceError on a race) and bit-equal to the reference.
Its untracked twin (tracking switched off with the test-only switch) must race: the tests fail
when automatic synchronization is removed.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures, untracked

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim

Pipelines = Sequence[Optional["tp.Pipeline"]]


_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


def assert_equal(reference: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> None:
    assert len(reference) == len(got)
    for i, (r, g) in enumerate(zip(reference, got)):
        assert torch.equal(r.cpu(), g.cpu()), f"value {i} differs from the default pipeline's"


def check_workload(run: Callable[[Pipelines], List[torch.Tensor]], pipelines: Pipelines,
                   race_too: bool = True) -> None:
    """run(pipelines) is race-free and bit-equal to run([None, ...]); untracked, it races."""
    reference = run([None] * len(pipelines))
    got = run(pipelines)
    assert sim.races() == []
    assert_equal(reference, got)
    if race_too:
        with untracked():
            run(pipelines)
            assert sim.races(), "the untracked twin did not race"


# ---- GPipe: micro-batches through two stages on two devices, one pipeline per stage ---------------
def make_stages(seed: int = 0) -> Tuple["nn.Module", "nn.Module"]:
    torch.manual_seed(seed)
    stage0 = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    stage1 = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))
    return stage0.to("sim:0"), stage1.to("sim:1")


def gpipe(optimizer: str) -> Callable[[Pipelines], List[torch.Tensor]]:
    def run(pipelines: Pipelines) -> List[torch.Tensor]:
        p0, p1 = pipelines
        stage0, stage1 = make_stages()
        params = list(stage0.parameters()) + list(stage1.parameters())
        if optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.Adam(params, lr=0.01, foreach=True)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x = torch.randn(32, 32, generator=g).to("sim:0")
            target = torch.randn(32, 4, generator=g).to("sim:1")
            outputs = []
            for mb in x.chunk(4):                       # forward, micro-batch by micro-batch
                with tp.pipeline(p0):
                    h = stage0(mb)
                with tp.pipeline(p1):
                    outputs.append(stage1(h.to("sim:1")))
            with tp.pipeline(p1):
                loss = F.mse_loss(torch.cat(outputs), target)
            loss.backward()                             # backward through both stages
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses + [p.detach() for p in params]
    return run


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_gpipe_micro_batches_over_two_devices(optimizer: str) -> None:
    check_workload(gpipe(optimizer), [tp.Pipeline(), tp.Pipeline(tp.get_worker_thread(1))])


# ---- an Inception-style block: four branches on four pipelines, concatenated ---------------------
class Inception(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(8, 4, 1)
        self.b3 = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 5, padding=2))
        self.pool = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), nn.Conv2d(8, 4, 1))

    def forward(self, x: torch.Tensor, pipelines: Pipelines) -> torch.Tensor:
        outs = []
        for branch, p in zip((self.b1, self.b3, self.b5, self.pool), pipelines):
            with tp.pipeline(p):
                outs.append(branch(x))
        return torch.relu(torch.cat(outs, dim=1))


def inception(pipelines: Pipelines) -> List[torch.Tensor]:
    torch.manual_seed(3)
    block = Inception().to("sim:0")
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    x = torch.randn(2, 8, 12, 12).to("sim:0")
    outs = []
    for _ in range(2):
        y = block(x, pipelines)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(y.detach())
    return outs + [p.detach() for p in block.parameters()]


def test_inception_block_with_a_pipeline_per_branch() -> None:
    check_workload(inception, [tp.Pipeline() for _ in range(4)])


# ---- an asynchronous checkpoint of model and optimizer state, while training continues -----------
def checkpoint_while_training() -> List[Tuple[Any, Any]]:
    """Saves {"model": ..., "optim": ...} on a saver pipeline three times while training goes on;
    returns (what was saved, the values at submission) pairs."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)).to("sim:0")
    opt = torch.optim.Adam(model.parameters(), lr=0.1, foreach=True)
    saver = tp.Pipeline(tp.get_worker_thread(1))
    x = torch.randn(8, 16).to("sim:0")

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def save(state: Dict[str, Any]) -> Dict[str, Any]:
        time.sleep(0.05)                  # slow storage: training goes on meanwhile
        return {k: _to_cpu(v) for k, v in state.items()}

    step()
    futures, expected = [], []
    for _ in range(3):
        state = {"model": model.state_dict(), "optim": opt.state_dict()}  # exp_avg: 4 levels down
        expected.append(_to_cpu(copy.deepcopy(state)))
        futures.append(saver.submit(save, state))
        for _ in range(2):
            step()                        # writes parameters and exp_avg while the save reads
    return [(f.wait(), want) for f, want in zip(futures, expected)]


def test_async_checkpoint_saves_the_values_at_submission() -> None:
    for got, want in checkpoint_while_training():
        _assert_same(got, want)
    assert sim.races() == []
    with untracked():                     # nothing pins the state: the save sees later steps
        pairs = checkpoint_while_training()
        stale = 0
        for got, want in pairs:
            try:
                _assert_same(got, want)
            except AssertionError:
                stale += 1
        assert stale or sim.races(), "untracked, the checkpoint did not see later values"


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return copy.deepcopy(value)


def _assert_same(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{where}: saved a later value than at submission"
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# ---- torch.func transforms inside pipelines --------------------------------------------------------
def func_transforms(pipelines: Pipelines) -> List[torch.Tensor]:
    (p,) = pipelines
    torch.manual_seed(5)
    w = torch.randn(8, 8).to("sim:0")
    xs = torch.randn(4, 8).to("sim:0") * 2           # written on the default stream

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sum()

    with tp.pipeline(p):
        batched = torch.vmap(lambda r: r * 2 + 1)(xs)
        grads = torch.func.grad(f)(xs[0])
        jac = torch.func.jacrev(lambda x: torch.sin(x) * x)(xs[1])
        _, tangent = torch.func.jvp(lambda x: torch.exp(x), (xs[2],), (torch.ones_like(xs[2]),))
    return [batched + 0, grads + 0, jac + 0, tangent + 0]  # read back on the default stream


def test_torch_func_transforms_inside_a_pipeline() -> None:
    check_workload(func_transforms, [tp.Pipeline()])


# ---- a __torch_dispatch__ wrapper subclass (the pattern DTensor is built on) -----------------------
if IN_CHILD:
    from torch.utils._pytree import tree_map

    class Wrapper(torch.Tensor):
        """A wrapper subclass: no storage of its own; ops run on the wrapped tensor."""

        elem: torch.Tensor

        @staticmethod
        def __new__(cls, elem: torch.Tensor) -> "Wrapper":
            r = torch.Tensor._make_wrapper_subclass(
                cls, elem.size(), strides=elem.stride(), dtype=elem.dtype, device=elem.device,
                requires_grad=elem.requires_grad)
            r.elem = elem
            return r

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            unwrap = lambda t: t.elem if isinstance(t, Wrapper) else t  # noqa: E731
            wrap = lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
            return tree_map(wrap, out)


def wrapper_subclass(pipelines: Pipelines) -> List[torch.Tensor]:
    (p,) = pipelines
    x = Wrapper(torch.ones(4096).to("sim:0") * 3)     # written on the default stream
    with tp.pipeline(p):
        y = x * 2 + 1                                 # real ops on p's stream, nested
        y.mul_(2)
    z = y + x                                         # back on the default stream
    return [z.elem]


def test_wrapper_subclass_inside_a_pipeline() -> None:
    check_workload(wrapper_subclass, [tp.Pipeline()])


# ---- activation checkpointing -----------------------------------------------------------------------
def activation_checkpointing(pipelines: Pipelines) -> List[torch.Tensor]:
    p0, p1 = pipelines
    torch.manual_seed(6)
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.GELU()).to("sim:0") for _ in range(3)]
    params = [q for b in blocks for q in b.parameters()]
    x = torch.randn(16, 32).to("sim:0").requires_grad_()
    h = x
    for i, block in enumerate(blocks):
        with tp.pipeline(p0 if i % 2 == 0 else p1):
            h = checkpoint.checkpoint(block, h, use_reentrant=False)
    h.sum().backward()                                # recomputation runs in backward
    return [h.detach(), x.grad] + [q.grad for q in params]


def test_activation_checkpointing_across_pipelines() -> None:
    check_workload(activation_checkpointing, [tp.Pipeline(), tp.Pipeline()])


# ---- DDP over Gloo (2 ranks) with pipelines ----------------------------------------------------------
def test_ddp_over_gloo_inside_pipelines() -> None:
    """Two ranks train a DDP model with the forward in a pipeline and a logging pipeline reading
    every loss; parameters are bit-equal to the same training without pipelines, on both ranks.
    (CPU tensors: Gloo cannot reduce sim tensors.)"""
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    from test_distributed import run_ranks
    for r in run_ranks("ddp_in_pipelines", world=2, timeout_s=240.0):
        assert r["equal"], "DDP under pipelines computed other parameters"
        assert r["same_across_ranks"]


install_proxies(globals(), __file__)
