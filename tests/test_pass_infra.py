"""The pass driver: contracts, disabling, and errors that name the failing pass."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx

from autopar.errors import PassError
from autopar.passes.infra import PassContext, PassManager, PassResult, graph_pass, graph_property


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


def test_a_pass_hands_on_its_product_in_its_result_not_in_the_options():
    @graph_pass()
    def counts_nodes(gm, ctx):
        return PassResult(gm, False, len(gm.graph.nodes))

    @graph_pass()
    def writes_options(gm, ctx):
        ctx.options["count"] = 1
        return PassResult(gm, False)

    ctx = PassContext(options={"tp": 2})
    PassManager([counts_nodes]).run(_gm(), ctx)
    assert ctx.results == {"counts_nodes": 4} and ctx.options == {"tp": 2}
    with pytest.raises(PassError, match="'writes_options' wrote ctx.options"):
        PassManager([writes_options]).run(_gm(), PassContext())


def test_disable_by_name():
    ctx = PassContext()
    PassManager([make_a, explodes], disabled=["explodes"]).run(_gm(), ctx)
    assert "explodes" not in ctx.timings
    with pytest.raises(PassError, match="unknown pass"):
        PassManager([make_a], disabled=["nope"])


@graph_property("has_relu")
def has_relu(gm, ctx):
    """A test property: the graph computes a relu."""
    if any(n.op == "call_module" and isinstance(gm.get_submodule(n.target), torch.nn.ReLU)
           for n in gm.graph.nodes):
        return None
    return "no relu in the graph"


@graph_pass(requires=("has_relu",))
def needs_relu(gm, ctx):
    return PassResult(gm, False)


@graph_pass(ensures=("has_relu",))
def claims_relu(gm, ctx):
    return PassResult(gm, False)


def test_properties_are_predicates_on_the_graph():
    """A required property is evaluated on the graph the pass gets, not looked up as a label:
    it holds of a graph with a relu whatever ran before, and fails by name and reason on one
    without, even after a pass that claims it; a pass that claims a property it does not
    establish fails too."""
    relu = _gm()
    PassManager([needs_relu]).run(relu, PassContext())
    plain = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(PassError, match="'needs_relu' cannot run after '<start>'") as err:
        PassManager([needs_relu]).run(plain, PassContext(properties={"has_relu"}))
    assert "has_relu: no relu in the graph" in str(err.value)
    with pytest.raises(PassError, match="'claims_relu' did not establish") as err:
        PassManager([claims_relu]).run(plain, PassContext())
    assert "no relu" in str(err.value)


def test_the_sharding_search_run_before_the_bias_split_fails_by_name(tiny_models):
    """shard_graph requires gemm_bias_split: on the captured GPT (linears with biases) it fails
    naming the first linear that still adds its bias; after split_gemm_bias it runs."""
    from autopar.passes.shard import shard_graph, split_gemm_bias
    from autopar.passes.analyze import analyze
    from autopar.tensor_parallel import TPCostSpec

    captured = tiny_models["gpt"][4]
    analyze(captured)
    options = {"tp": 2, "cost": TPCostSpec(), "sizes": {"b": 2, "s": 16}}
    gm = copy.deepcopy(captured.gm)
    with pytest.raises(PassError, match="gemm_bias_split: .* adds its bias"):
        PassManager([shard_graph]).run(gm, PassContext(captured=captured, options=dict(options)))
    ctx = PassContext(captured=captured, options=dict(options))
    PassManager([split_gemm_bias, shard_graph]).run(gm, ctx)
    assert {"gemm_bias_split", "placements"} <= ctx.properties


def test_graphs_read_only_defers_code_generation_but_not_behaviour():
    """Inside the planner's ``graphs_read_only``, graph modules (built by ``new_graph_module``
    and recompiled by the pass manager) generate their Python code when first run: the same
    result as an eager one; outside, construction compiles as torch's GraphModule does."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from autopar.ir import copy_graph_module, graphs_read_only

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.relu(self.lin(x)) * 2

    gm = torch.fx.symbolic_trace(Net())
    x = torch.randn(5, 4)

    @graph_pass()
    def negate(g, ctx):
        out = next(n for n in g.graph.nodes if n.op == "output")
        with g.graph.inserting_before(out):
            neg = g.graph.call_function(torch.neg, (out.args[0],))
        out.args = (neg,)
        return PassResult(g, True)

    with graphs_read_only():
        lazy, _ = copy_graph_module(gm)
        lazy = PassManager([negate]).run(lazy, PassContext(captured=None))
    assert isinstance(lazy, _LazyGraphModule)
    eager, _ = copy_graph_module(gm)
    assert not isinstance(eager, _LazyGraphModule)
    assert torch.equal(lazy(x), -gm(x))  # compiled on first call, the pass's edit included
    assert "neg" in lazy.code


def test_without_torchs_lazy_switch_graphs_compile_when_built(monkeypatch):
    """A torch without ``torch.fx._lazy_graph_module`` (a private module): ``graphs_read_only``
    changes nothing and ``new_graph_module`` builds torch's plain GraphModule."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    import autopar.ir as ir

    monkeypatch.setattr(ir, "_lazy", None)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 3))
    with ir.graphs_read_only():
        built = ir.new_graph_module(gm, gm.graph)
    assert type(built).__mro__[1] is torch.fx.GraphModule
    assert not isinstance(built, _LazyGraphModule)
    x = torch.randn(2, 4)
    assert torch.equal(built(x), gm(x))
