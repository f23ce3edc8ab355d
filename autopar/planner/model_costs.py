"""A model's layers as cost templates (:mod:`autopar.planner.layer_templates`), built once per
captured graph, and the tensor-parallel layouts the planner solves for it.

:class:`ModelCosts` turns the analysis pass's results (its profile of bytes per node, and its
``gemm_dims`` and ``saved_tensors``, the same derivations the profile uses) into one
:class:`~autopar.planner.layer_templates.Template` per layer (repeated blocks share one; a
shallower capture is extended to the real depth), and caches the sharding search's layouts,
solved once per ``(t, SP)`` and shared across micro-batches where that stays exact
(:meth:`ModelCosts.prepare_layouts`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import sympy
import torch.fx

from autopar.errors import AutoparError
from autopar.ir import (BATCH, SEQ, LayerKind, NodeKind, TensorSpec, info, next_block_names,
                        op_name)
from autopar.planner.layer_templates import (BIAS_OP, CONV_OP, EXPERT_OP, LayerSplit, Template,
                                             TensorRef, Term, TermKind, layer_split,
                                             seq_degree)
from autopar.planner.tp_layout import TPLayout, solve_layout

__all__ = ["ModelCosts"]


def _spec(a: Any) -> TensorSpec | None:
    return info(a).spec if isinstance(a, torch.fx.Node) else None


def _has_bias_vector(node: torch.fx.Node, op: str) -> bool:
    if op == "linear":
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    elif op == "addmm":
        bias = node.args[0]
    else:
        return False
    spec = _spec(bias)
    return spec is not None and spec.ndim == 1


def _table_key(node: torch.fx.Node, op: str) -> str:
    """The op's name in a device's ``op_table``: the graph's, with GELU's approximation."""
    if op == "gelu" and node.kwargs.get("approximate", "none") == "tanh":
        return "gelu(tanh)"
    return op


def _size_hint(expr: Any) -> float:
    """A symbolic element count at b = 1, s = 1024 (to pick a node's largest tensor)."""
    try:
        return float(sympy.sympify(expr).subs({BATCH: 1, SEQ: 1024}))
    except (TypeError, ValueError):
        return 0.0


def _is_weight(a: Any) -> bool:
    from autopar.passes.analyze import view_root

    return isinstance(a, torch.fx.Node) and info(view_root(a)).kind is NodeKind.PARAMETER \
        and info(a).requires_grad


#: GEMM ops whose second operand may be a weight: its gradient is a GEMM of its own
#: (``dW = x^T dy``), as a linear layer's. A ``matmul`` / ``mm`` may read it as its first
#: operand too (``W @ x``: ``dW = dy x^T``).
_WEIGHT_GEMMS = frozenset({"linear", "matmul", "mm"})
_EITHER_OPERAND = frozenset({"matmul", "mm"})

_UNKNOWN = object()


class ModelCosts:
    """A captured model's costs as per-layer templates (repeated blocks share one), and its
    tensor-parallel layouts (solved on demand, cached).

    Independent of the cluster and the plan: :class:`CostModel` prices the templates.
    """

    def __init__(self, captured: Any, profile: Any = None, *, name: str | None = None,
                 depth: int | None = None) -> None:
        """``depth``: the number of repeated blocks the real model has, when ``captured`` is
        a shallower copy of it (same shapes, fewer blocks: capture time grows with depth).
        Blocks are identical computations, so the last captured block stands for the rest."""
        from autopar.passes.analyze import analyze, moe_dims

        self.captured = captured
        self.profile = profile if profile is not None else analyze(captured)
        #: Why the sequence cannot be split over cp ranks (None: it can), found on first use.
        self._cp_problem: object = _UNKNOWN
        self.name = name
        self.graph_float_bytes = self.profile.layers[0].graph_float_bytes
        #: The capture computes in a 16-bit dtype (a mixed-precision capture): its fp32
        #: tensors stay fp32 in training (TensorRef.wide).
        self._narrow = any(
            n.op == "call_function" and isinstance(info(n).spec, TensorSpec)
            and info(n).spec.dtype in (torch.bfloat16, torch.float16)
            for n in captured.gm.graph.nodes)
        layers = captured.layers
        self._param_numel = {}
        for p in captured.params.values():
            for fqn in (p.fqn, *p.aliases):
                self._param_numel[fqn] = int(p.spec.numel)
        self._canonical = {a: p.fqn for p in captured.params.values() for a in (p.fqn, *p.aliases)}
        self._frozen = frozenset(p.fqn for p in captured.params.values() if not p.requires_grad)
        self._layouts: dict[tuple, TPLayout | str] = {}
        self._splits: dict[tuple[int, int], LayerSplit] = {}
        saved = self._saved_entries()
        # one template per signature, built from its last layer (the first block may carry
        # tables made before the blocks; later ones are the repeated steady state)
        last_of: dict[str, int] = {}
        for layer in layers:
            last_of[layer.signature] = layer.index
        built: dict[str, Template] = {}
        self.templates: list[Template] = []
        for layer in layers:
            key = f"{layer.kind.value}:{layer.signature}"
            if key not in built:
                built[key] = self._template(layers[last_of[layer.signature]], saved,
                                            first=layer)
            self.templates.append(built[key])
        self.layer_names = [layer.name for layer in layers]
        self.kinds = [layer.kind for layer in layers]
        blocks = [layer.index for layer in layers if layer.kind is LayerKind.BLOCK]
        self.extended = bool(depth and blocks and depth > len(blocks))
        if depth is not None and depth < len(blocks):
            raise ValueError(f"depth={depth} is below the {len(blocks)} blocks captured")
        if self.extended:
            last = blocks[-1]
            extra = depth - len(blocks)
            self.templates[last + 1:last + 1] = [self.templates[last]] * extra
            names = next_block_names(layers[last].name, extra)
            self.layer_names[last + 1:last + 1] = names
            self.kinds[last + 1:last + 1] = [LayerKind.BLOCK] * extra
        uses: dict[int, int] = {}
        for t in self.templates:
            uses[id(t)] = uses.get(id(t), 0) + 1
        for t in self.templates:
            t.shared = uses[id(t)] > 1
        self.num_layers = len(self.templates)
        #: Experts per mixture-of-experts block, their greatest common divisor over the blocks
        #: (what ep must divide; 0: no experts).
        self.num_experts = 0
        for node in captured.gm.graph.nodes:
            if node.op == "call_function" and op_name(node) == "moe_experts":
                self.num_experts = math.gcd(self.num_experts, int(moe_dims(node).experts))

    # -- construction -------------------------------------------------------------------------
    def _saved_entries(self) -> dict[str, list[tuple[TensorSpec, str, tuple[str, int] | None]]]:
        """Per layer name: (saved tensor, node it belongs to, (the op that saves it, input index)
        when it saves an input), charged exactly as the analysis pass charges them (a tensor
        saved by several ops once; tables made before the blocks and read by all of them to
        their maker)."""
        from autopar.passes.analyze import identity_root, saved_tensors

        captured = self.captured
        index = {layer.name: layer.index for layer in captured.layers}
        kind = {layer.name: layer.kind for layer in captured.layers}
        nodes = {n.name: n for n in captured.gm.graph.nodes}
        charged: set[Any] = set()
        out: dict[str, list[tuple[TensorSpec, str, tuple[str, int] | None]]] = {
            layer.name: [] for layer in captured.layers}
        for node in captured.gm.graph.nodes:
            if node.op != "call_function":
                continue
            roots = [identity_root(a).name for a in node.all_input_nodes]
            for key, spec in saved_tensors(node, op_name(node)):
                if key in charged:
                    continue
                charged.add(key)
                target = node
                owner = key if isinstance(key, str) else key[0]
                producer = nodes.get(key) if isinstance(key, str) else None
                if producer is not None:
                    p_layer = info(producer).layer
                    if (kind.get(p_layer) is LayerKind.PRE
                            and index.get(info(node).layer, 0) > index.get(p_layer, 0) + 1):
                        target = producer
                layer = info(target).layer
                reader = (node.name, roots.index(key)) if isinstance(key, str) \
                    and key != node.name and key in roots else None
                if layer in out:
                    out[layer].append((spec, owner, reader))
        return out

    def _template(self, layer: Any,
                  saved: Mapping[str, list[tuple[TensorSpec, str, tuple[str, int] | None]]],
                  first: Any = None) -> Template:
        """The template of ``layer`` (its signature's last captured instance); ``first``: the
        signature's first instance, whose boundary is what a cut between two of them sends."""
        from autopar.passes.analyze import (CONV_OPS, GEMM_OPS, VIEW_OPS, conv_dims,
                                            conv_images, conv_kernel_elements, gemm_dims,
                                            moe_dims)

        captured = self.captured
        exprs: list[sympy.Expr] = []

        def add(expr: Any) -> int:
            exprs.append(sympy.sympify(expr))
            return len(exprs) - 1

        terms: list[Term] = []
        gemm_flops = sympy.Integer(0)
        core_flops = sympy.Integer(0)
        core_nodes = self._core_nodes(layer)
        calls = grad_calls = 0
        moe_rows: list[int] = []
        moe_experts: list[int] = []
        moe_params: set[str] = set()
        for name in layer.nodes:
            node = captured.node(name)
            if node.op != "call_function":
                continue
            meta = info(node)
            op = op_name(node)
            if op != "getitem":  # indexing a tuple output is not an op call
                calls += 1
                grad_calls += bool(meta.requires_grad)
            moved = meta.bytes_read + meta.bytes_written
            if op in GEMM_OPS:
                gemm_flops = gemm_flops + meta.flops
                if name in core_nodes:
                    core_flops = core_flops + meta.flops
            if op in VIEW_OPS or (moved == 0 and meta.flops == 0):
                continue
            core = name in core_nodes
            grads = sum(1 for a in node.all_input_nodes
                        if info(a).requires_grad and not _is_weight(a)
                        and info(a).kind not in (NodeKind.PARAMETER,))
            if op == "scaled_dot_product_attention":
                terms.append(Term(TermKind.ATTENTION, name, meta.requires_grad, False, grads, core,
                                   add(meta.flops)))
                add(moved)
                q = info(node.args[0]).spec
                add(q.shape[-2])  # sequence
                add(q.shape[-1])  # head dim
                k, v_ = info(node.args[1]).spec, info(node.args[2]).spec
                add(k.numel + v_.numel)  # keys and values: what context parallelism exchanges
                continue
            if op == "moe_experts":  # two grouped GEMMs per routed token, its dispatch
                d = moe_dims(node)
                gemm_flops = gemm_flops + meta.flops
                for n_, k_ in ((d.gate_up, d.hidden), (d.hidden, d.inner)):
                    idx = add(d.experts)  # price_layer runs E / ep GEMMs
                    add(d.rows)
                    add(n_)
                    add(k_)
                    terms.append(Term(TermKind.GEMM, name, meta.requires_grad, True, grads, False,
                                       idx, EXPERT_OP))
                # gather the routed rows, the activation, weigh and add back (4 row passes)
                x = info(node.args[0]).spec
                element = x.nbytes / x.numel
                terms.append(Term(TermKind.MEMORY, name, meta.requires_grad, False, grads, False,
                                   add(d.rows * d.gate_up), ""))
                add(element * d.rows * (4 * d.hidden + 2 * d.gate_up))
                add(d.rows * d.gate_up)
                moe_rows.append(add(d.rows * d.hidden))
                moe_experts.append(int(d.experts))
                moe_params.update(info(a).fqn for a in node.args[3:5]
                                  if isinstance(a, torch.fx.Node) and info(a).fqn)
                continue
            if op in CONV_OPS:  # its implicit GEMM, per group, at its own bytes
                groups, m, n, k = conv_dims(node)
                idx = add(groups)
                for d in (m, n, k, moved, conv_kernel_elements(node), conv_images(node)):
                    add(d)
                terms.append(Term(TermKind.GEMM, name, meta.requires_grad,
                                  _is_weight(node.args[1]), grads, core, idx, CONV_OP))
                continue
            dims = gemm_dims(node) if op in GEMM_OPS else None
            if dims is not None:
                # x @ W or W @ x (a parameter read through views: W.t(), a LoRA adapter)
                # computes its weight's gradient as a linear does
                weighted = op in _WEIGHT_GEMMS and (
                    _is_weight(node.args[1])
                    or (op in _EITHER_OPERAND and _is_weight(node.args[0])))
                idx = add(dims[0])
                for d in dims[1:]:
                    add(d)
                terms.append(Term(TermKind.GEMM, name, meta.requires_grad, weighted, grads, core,
                                   idx, BIAS_OP if _has_bias_vector(node, op) else ""))
                continue
            # memory-bound (including GEMM-like ops the model has no shape rule for)
            terms.append(Term(TermKind.MEMORY, name, meta.requires_grad, False, grads, core,
                               add(meta.flops), _table_key(node, op)))
            add(moved)
            add(max((s.numel for s in (_spec(a) for a in (*node.all_input_nodes, node))
                     if s is not None and s.is_float), key=_size_hint, default=0))

        def tensor(owner: str, spec: TensorSpec, core: bool = False,
                   reader: tuple[str, int] | None = None) -> TensorRef:
            return TensorRef(owner, spec.is_float, core,
                             add(spec.numel if spec.is_float else spec.nbytes), reader,
                             wide=self._narrow and spec.dtype == torch.float32)

        # saved activations (the placement their saving op reads them in decides the share)
        saved_tensors = [tensor(owner, spec, seq_degree(spec.numel) >= 2, reader)
                         for spec, owner, reader in saved.get(layer.name, ())]
        # the largest tensor a gradient flows through (at its width in the capture)
        carrying = [n for n in (captured.node(m) for m in layer.nodes)
                    if n.op == "call_function" and isinstance(info(n).spec, TensorSpec)
                    and info(n).spec.is_float and info(n).requires_grad]
        largest = max(carrying, key=lambda n: _size_hint(info(n).spec.nbytes), default=None)
        transient = [tensor(largest.name, info(largest).spec)] if largest is not None else []
        # the block's input (all full recomputation keeps)
        checkpoint = []
        inside = set(layer.nodes)
        prev = layer.index - 1
        seen: set[str] = set()
        for name in layer.nodes:
            for a in captured.node(name).all_input_nodes:
                if a.name in inside or a.name in seen or info(a).spec is None:
                    continue
                if info(a).kind in (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT):
                    continue
                src = captured.layer(info(a).layer).index if info(a).layer else -1
                if src != prev:
                    continue
                seen.add(a.name)
                checkpoint.append(tensor(a.name, info(a).spec))
        # what a pipeline cut after this layer sends
        lc = self.profile.layers[layer.index]
        boundary = [tensor(name, info(captured.node(name)).spec) for name in lc.boundary_tensors]
        inner = boundary
        if first is not None and first.index != layer.index:
            inner = [tensor(name, info(captured.node(name)).spec)
                     for name in self.profile.layers[first.index].boundary_tensors]
        # parameters the layer reads (a tied table is read by two layers)
        params: dict[str, int] = {}
        for name in layer.nodes:
            for fqn in info(captured.node(name)).reads:
                canon = self._canonical.get(fqn)
                if canon is not None:
                    params[canon] = self._param_numel[canon]
        for fqn in layer.params:  # owned but not read directly (rare)
            canon = self._canonical.get(fqn, fqn)
            if canon in self._param_numel and canon not in params:
                params[canon] = self._param_numel[canon]
        return Template(
            signature=layer.signature, kind=layer.kind, representative=layer.index,
            layer_name=layer.name, terms=terms, exprs=exprs, saved=saved_tensors,
            checkpoint=checkpoint, boundary=boundary, gemm_flops=add(gemm_flops),
            core_flops=add(core_flops), params=params, nodes=calls,
            # one gradient accumulation per trainable parameter
            grad_nodes=grad_calls + len(params.keys() - self._frozen),
            frozen=frozenset(params.keys() & self._frozen),
            moe_rows=moe_rows, moe_experts=moe_experts,
            expert_params=frozenset(self._canonical.get(f, f) for f in moe_params),
            inner_boundary=inner, transient=transient)

    def _core_nodes(self, layer: Any) -> set[str]:
        """The attention core: fused attention, and the nodes whose output grows as s^2
        (scores, softmax, their dropout), plus the GEMMs that read or make them."""
        captured = self.captured
        out: set[str] = set()
        for name in layer.nodes:
            node = captured.node(name)
            if node.op != "call_function":
                continue
            spec = info(node).spec
            if op_name(node) == "scaled_dot_product_attention":
                out.add(name)
            elif spec is not None and spec.is_float and info(node).requires_grad \
                    and seq_degree(spec.numel) >= 2:
                out.add(name)
        for name in list(out):  # the matmul that turns the probabilities into the output
            for user in captured.node(name).users:
                if op_name(user) in ("matmul", "bmm") and user.name in set(layer.nodes):
                    out.add(user.name)
        return out

    # -- tensor-parallel layouts ---------------------------------------------------------------
    def layout(self, tp: int, sequence_parallel: bool, *, cost: Any, sizes: Mapping[str, int]
               ) -> TPLayout | None:
        """The sharding search's layout for ``tp`` (None at tp=1); raises
        :class:`autopar.errors.AutoparError` (ShardingError, ...) when tp does not fit."""
        if tp == 1:
            return None
        key = (tp, sequence_parallel, cost, tuple(sorted(sizes.items())))
        hit = self._layouts.get(key)
        if hit is None:
            try:
                hit = solve_layout(self.captured, tp, sequence_parallel, cost=cost, sizes=sizes,
                                   depth=self.kinds.count(LayerKind.BLOCK) or None)
            except AutoparError as exc:
                found = f" ({_short(exc.found)})" if exc.found else ""
                hit = f"{type(exc).__name__}: {exc.summary}{found}"
            self._layouts[key] = hit
        if isinstance(hit, str):
            raise _LayoutProblem(hit)
        return hit

    def solved_layouts(self) -> dict[tuple, TPLayout | str]:
        """The layouts solved so far (and the reasons a tp did not fit), by their key: what a
        process that solved some hands to another (:meth:`adopt_layouts`)."""
        return dict(self._layouts)

    def adopt_layouts(self, solved: Mapping[tuple, TPLayout | str]) -> None:
        """Layouts another process solved on the same captured graph (``solved_layouts``)."""
        for key, value in solved.items():
            self._layouts.setdefault(key, value)

    def prepare_layouts(self, tp: int, sequence_parallel: bool, *, cost: Any,
                        sizes: Sequence[Mapping[str, int]], vary: str = "b") -> None:
        """Solve the layouts of ``sizes`` (which differ only in ``vary``, the micro-batch) with
        as few sharding ILPs as exactness allows, and cache them for :meth:`layout`.

        Within one roofline regime of every GEMM, each term of the sharding ILP's objective
        is affine in the micro-batch b for a fixed placement x: f_b(x) = A(x) b + C(x) (compute
        and traffic grow with b, a collective's latency and the parameters' state do not). The
        optimum g(b) = min_x f_b(x) is then concave, so a placement x* optimal at b1 and at b2
        has f_b(x*) = g(b) on [b1, b2]: the chord of a concave function lies below it, and
        f_b(x*) is that chord. Hence: solve the smallest and largest b; when either one's
        solved point, priced in the other's program, is optimal there too (the constraints
        do not depend on b) and every GEMM keeps its roofline regime, every b between takes
        that point; otherwise bisect. Ties are common (a cast placed sharded or
        replicated at equal cost), so the test is on the objective, not on the placements.
        A memory limit in the ILP makes the feasible set depend on b: then every size is
        solved."""
        if tp == 1 or getattr(cost, "memory_limit", None) is not None:
            return
        points = sorted({tuple(sorted(sz.items())): dict(sz) for sz in sizes}.values(),
                        key=lambda sz: sz[vary])

        def solved(i: int) -> TPLayout | None:
            try:
                return self.layout(tp, sequence_parallel, cost=cost, sizes=points[i])
            except _LayoutProblem:
                return None

        def fill(lo: int, hi: int) -> None:
            a, b = solved(lo), solved(hi)  # the ends of a bisection's halves too (cached)
            if hi - lo < 2:
                return
            # either end's point, optimal at the other end too, is optimal between them
            shared = None if a is None or b is None else (
                a if a.optimal_at(b) else b if b.optimal_at(a) else None)
            if shared is not None:
                for i in range(lo + 1, hi):
                    key = (tp, sequence_parallel, cost, tuple(sorted(points[i].items())))
                    self._layouts.setdefault(key, dataclasses.replace(
                        shared, sizes=dict(points[i]), solve_s=0.0,
                        solved_at=dict(shared.sizes)))
                return
            mid = (lo + hi) // 2
            fill(lo, mid)
            fill(mid, hi)

        if points:
            fill(0, len(points) - 1)

    def tp_problem(self, tp: int, sequence_parallel: bool, *, cost: Any,
                   sizes: Mapping[str, int]) -> str | None:
        """Why tensor parallelism of ``tp`` does not fit the model (None if it does)."""
        try:
            self.layout(tp, sequence_parallel, cost=cost, sizes=sizes)
        except _LayoutProblem as exc:
            return str(exc)
        return None

    @property
    def has_sequence(self) -> bool:
        """Whether the inputs hold a sequence dim (an image model's do not: its patches are
        made inside the graph)."""
        from autopar.ir import SEQ

        return SEQ in self.captured.example_sizes

    def cp_problem(self) -> str | None:
        """Why the sequence cannot be split over context-parallel ranks (None if it can): the
        transform's refusal (passes/context_parallel.py) on the captured graph, once."""
        if self._cp_problem is _UNKNOWN:
            from autopar.passes.context_parallel import context_parallelize

            try:
                context_parallelize(self.captured.gm)
                self._cp_problem = None
            except AutoparError as exc:
                self._cp_problem = exc.summary + (f": {exc.found}" if exc.found else "")
        return self._cp_problem  # type: ignore[return-value]

    def split(self, template: Template, layout: TPLayout | None, tp: int) -> LayerSplit:
        key = (id(template), id(layout))
        out = self._splits.get(key)
        if out is None:
            out = layer_split(template, layout, tp)
            self._splits[key] = out
        return out

    # -- queries ------------------------------------------------------------------------------
    def template(self, layer: int) -> Template:
        return self.templates[layer]

    @property
    def total_params(self) -> int:
        """The real model's parameters: the capture's, each once (a tied table once), and the
        last block's own for each block a shallower capture left out."""
        total = sum(int(p.spec.numel) for p in self.captured.params.values())
        if self.extended:
            extra = self.num_layers - len(self.captured.layers)
            block = max(i for i, k in enumerate(self.kinds[:len(self.captured.layers)])
                        if k is LayerKind.BLOCK)
            total += extra * sum(self.templates[block].params.values())
        return total

    @property
    def layer_kinds(self) -> list[LayerKind]:
        return list(self.kinds)

    def tp_placement(self, layout: TPLayout | None) -> list[dict[str, Any]]:
        """Each GEMM's tensor-parallel split in ``layout``, once per distinct layer: layers,
        module, op node, split."""
        if layout is None:
            return []
        rows = []
        seen: dict[int, list[int]] = {}
        for i, t in enumerate(self.templates):
            seen.setdefault(id(t), []).append(i)
        for idxs in seen.values():
            t = self.templates[idxs[0]]
            rep = self.captured.layers[t.representative]
            for name in rep.nodes:
                g = layout.gemm_sharding.get(name)
                if g is None:
                    continue
                module = info(self.captured.node(name)).module_path
                if rep.kind is LayerKind.BLOCK:
                    module = module.replace(rep.name + ".", "", 1)
                rows.append({"layers": [idxs[0], idxs[-1]], "count": len(idxs),
                             "module": module, "node": name, "sharding": g.value})
        return rows


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _LayoutProblem(Exception):
    """tensor parallelism of some degree does not fit the model (the message says why)."""
