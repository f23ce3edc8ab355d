"""The pass driver: contracts, disabling, and errors that name the failing pass."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from autopar.errors import PassError
from autopar.passes.infra import PassContext, PassManager, PassResult, graph_pass


def _gm():
    return torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))


@graph_pass(ensures=("a",))
def make_a(gm, ctx):
    return PassResult(gm, False)


@graph_pass(requires=("a",), ensures=("b",))
def needs_a(gm, ctx):
    return PassResult(gm, False)


@graph_pass()
def explodes(gm, ctx):
    raise RuntimeError("boom")


def test_contracts_and_timings():
    ctx = PassContext()
    PassManager([make_a, needs_a]).run(_gm(), ctx)
    assert ctx.properties == {"a", "b"}
    assert set(ctx.timings) == {"make_a", "needs_a"}


def test_missing_requirement_is_named():
    with pytest.raises(PassError, match="'needs_a' cannot run after '<start>'"):
        PassManager([needs_a]).run(_gm(), PassContext())


def test_failure_names_pass_and_predecessor():
    with pytest.raises(PassError, match="'explodes' \\(after 'make_a'\\) failed: RuntimeError: boom"):
        PassManager([make_a, explodes]).run(_gm(), PassContext())


def test_disable_by_name():
    ctx = PassContext()
    PassManager([make_a, explodes], disabled=["explodes"]).run(_gm(), ctx)
    assert "explodes" not in ctx.timings
    with pytest.raises(PassError, match="unknown pass"):
        PassManager([make_a], disabled=["nope"])
