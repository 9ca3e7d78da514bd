"""Per-operator facts (csrc/runtime/op_facts.h): the one source of what an op reads and writes for
both the tracker (which looks an op up from its RecordFunction) and the sim device's kernels and
race checker (which look it up from the operator). Needs no device: the facts come from schemas.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

import torch_pipeline as tp

_C = tp._C

# name: (written arguments, transparent, non_blocking argument, syncs_host)
EXPECTED: Dict[str, tuple] = {
    # in place and out=: the schema marks the written argument (Tensor(a!))
    "aten::add_.Tensor": (["self"], False, None, False),
    "aten::add.out": (["out"], False, None, False),
    "aten::add.Tensor": ([], False, None, False),
    "aten::mul_.Scalar": (["self"], False, None, False),
    # views: no data access of their own
    "aten::view": ([], True, None, False),
    "aten::transpose.int": ([], True, None, False),
    "aten::select.int": ([], True, None, False),
    # metadata queries: host values read from metadata, no data access, no host sync
    "aten::size.int": ([], True, None, False),
    "aten::stride.int": ([], True, None, False),
    "aten::numel": ([], True, None, False),
    "aten::dim": ([], True, None, False),
    "aten::is_contiguous": ([], True, None, False),
    "aten::is_same_size": ([], True, None, False),
    "aten::_has_compatible_shallow_copy_type": ([], True, None, False),
    "aten::is_set_to": ([], True, None, False),
    # record_stream's schema writes self; it touches no data
    "aten::record_stream": (["self"], True, None, False),
    # copies: non_blocking found by name
    "aten::copy_": (["self"], False, "non_blocking", False),
    "aten::to.dtype": ([], True, "non_blocking", False),
    "aten::to.device": ([], True, "non_blocking", False),
    "aten::_to_copy": ([], False, "non_blocking", False),
    # c10d: no alias annotations; outputs, or in place the tensors, are written; a Work is a
    # handle, not a host value
    "c10d::allreduce_": (["tensors"], False, None, False),
    "c10d::broadcast_": (["tensors"], False, None, False),
    "c10d::allgather_": (["output_tensors"], False, None, False),
    "c10d::_allgather_base_": (["output_tensor"], False, None, False),
    "c10d::reduce_scatter_": (["output_tensors"], False, None, False),
    "c10d::recv_": (["tensors"], False, None, False),
    "c10d::send": ([], False, None, False),
    # the host waits: data-dependent output sizes, host values
    "aten::nonzero": ([], False, None, True),
    "aten::nonzero.out": (["out"], False, None, True),
    "aten::masked_select": ([], False, None, True),
    "aten::item": ([], False, None, True),
    "aten::_local_scalar_dense": ([], False, None, True),
    "aten::is_nonzero": ([], False, None, True),
    "aten::equal": ([], False, None, True),
}


def facts(name: str) -> Dict[str, Any]:
    return _C._sim_op_facts(name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_facts_of_an_op(name: str) -> None:
    if not _is_dispatcher_op(name):
        # Some metadata queries are TorchScript-only on some torch versions (aten::dim, numel,
        # is_contiguous on 2.11): neither the tracker nor the sim ever sees them there.
        _assert_torchscript_only(name)
        pytest.skip(f"{name} is not a dispatcher operator on torch {torch.__version__}")
    written, transparent, non_blocking, syncs_host = EXPECTED[name]
    f = facts(name)
    assert f["known"] and f["full_name"] == name
    assert (f["name"] + ("." + f["overload"] if f["overload"] else "")) == name
    got = (f["written"], f["transparent"], f["non_blocking"], f["syncs_host"])
    assert got == (written, transparent, non_blocking, syncs_host), f


def _dispatcher_overloads(name: str) -> List[str]:
    """The overloads of `name` that the dispatcher has (torch.ops also lists TorchScript-only
    ones, e.g. aten::size's default overload, which neither the tracker nor the sim ever sees)."""
    namespace, op = name.split("::")
    packet = getattr(getattr(torch.ops, namespace), op)  # AttributeError: not an operator at all
    out = []
    for o in packet.overloads():
        full = name if o == "default" else f"{name}.{o}"
        if _is_dispatcher_op(full):
            out.append(full)
    return out


def _is_dispatcher_op(full: str) -> bool:
    try:
        facts(full)
        return True
    except ValueError:
        return False


def _assert_torchscript_only(full: str) -> None:
    """`full` (an op name, maybe with an overload) is an operator TorchScript knows although the
    dispatcher lacks it on this torch: a real op of another torch version, not a misspelling."""
    namespace, op = full.split("::")
    op = op.split(".")[0]
    packet = getattr(getattr(torch.ops, namespace), op, None)
    assert packet is not None and packet.overloads(), (
        f"{full}: no operator of torch {torch.__version__}")
    assert not _dispatcher_overloads(f"{namespace}::{op}"), full


def test_every_listed_op_is_an_operator_and_its_facts_follow_the_list() -> None:
    """Each listed name is an operator of this torch; the overloads its dispatcher has follow the
    list. A name only TorchScript knows here (the dispatcher of another torch version has it) is
    allowed: the tracker and the sim never see it on this version."""
    lists = _C._sim_op_lists()
    assert lists["no_data"] and lists["host_sync"]
    registered = 0
    for name in lists["no_data"]:
        overloads = _dispatcher_overloads(name)
        if not overloads:
            _assert_torchscript_only(name)
        registered += bool(overloads)
        for full in overloads:
            f = facts(full)
            assert f["transparent"] and not f["syncs_host"], f
    for name in lists["host_sync"]:
        overloads = _dispatcher_overloads(name)
        assert overloads, f"{name} is not an operator of the dispatcher"
        for full in overloads:
            f = facts(full)
            assert f["syncs_host"] and not f["transparent"], f
    # (Not vacuous: most of the list is a dispatcher op on every torch version supported.)
    assert registered > len(lists["no_data"]) // 2, (registered, lists["no_data"])


def test_the_tracker_and_the_sim_share_one_facts_object_per_op() -> None:
    """The tracker's lookup (from a RecordFunction) and the sim kernels' (from the operator) return
    the same object, whichever comes first."""
    before = facts("aten::sub_.Tensor")  # looked up by operator first
    x = torch.ones(4)
    seen = _C._sim_op_facts_observed(lambda: (x.sub_(1), x.add(2), x.unsqueeze(0), x.nonzero()))
    names = [name for name, _ in seen]
    for expected in ("aten::sub_.Tensor", "aten::add.Tensor", "aten::unsqueeze", "aten::nonzero"):
        assert expected in names, names
    for name, ident in seen:
        assert facts(name)["id"] == ident, name
    assert before["id"] == dict(seen)["aten::sub_.Tensor"]


def test_an_unknown_op_name_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="aten::is_nonzero_"):
        facts("aten::is_nonzero_")
    with pytest.raises(ValueError, match="not a registered operator"):
        facts("aten::add.NoSuchOverload")


# Note [Writes a schema hides]: (operator, the bool argument that turns the write on, or None)
HIDDEN_WRITES = {
    "aten::batch_norm": "training",
    "aten::_batch_norm_impl_index": "training",
    "aten::native_batch_norm": "training",
    "aten::cudnn_batch_norm": "training",
    "aten::miopen_batch_norm": "training",
    "aten::instance_norm": "use_input_stats",
    "aten::batch_norm_update_stats": None,
    "aten::batch_norm_gather_stats": None,
    "aten::batch_norm_gather_stats_with_counts": None,
}
# Operators with running statistics that only read them (backward, eval-only, functional forms).
_READS_RUNNING_STATS = ("_backward", "_no_training", "_no_update", "_functional")


def test_running_statistics_a_schema_does_not_mark_are_written() -> None:
    """Batch norm's running_mean and running_var are updated in place by operators whose schemas
    do not mark them written (aten::batch_norm, native_batch_norm, instance_norm, ...): the facts
    mark them, written when `training` (`use_input_stats`) is true, so the tracker orders a later
    reader after the update and the sim sees the write. Every dispatcher operator of this torch
    with an unmarked running_mean is either in HIDDEN_WRITES or, by its name, a reader."""
    checked = set()
    for schema in torch._C._jit_get_all_schemas():
        names = [a.name for a in schema.arguments]
        if "running_mean" not in names:
            continue
        full = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        if not _is_dispatcher_op(full):
            continue
        f = facts(full)
        declared = schema.arguments[names.index("running_mean")].alias_info is not None
        if declared or any(marker in schema.name for marker in _READS_RUNNING_STATS):
            assert f["written_if"] is None, f
            assert declared == ("running_mean" in f["written"]), f
            continue
        assert schema.name in HIDDEN_WRITES, f"{full} may write its running statistics: list it"
        assert {"running_mean", "running_var"} <= set(f["written"]), f
        assert f["written_if"] == HIDDEN_WRITES[schema.name], f
        checked.add(schema.name)
    # (not vacuous: the forward operators every torch has)
    assert {"aten::batch_norm", "aten::native_batch_norm", "aten::instance_norm"} <= checked
