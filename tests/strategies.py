"""Hypothesis strategies and builders for graph-pass tests: random models traced by Dynamo, and raw FX graphs.

A :class:`ModelSpec` describes a model as op chains: ``pre`` ops, one block's ops repeated
``n_blocks`` times in a ``ModuleList``, then ``post`` ops. :func:`build_model` makes the
``nn.Module``; :func:`trace_with` traces it with Dynamo on CPU (``dynamic=True`` so Python floats
such as an RMSNorm ``eps`` are lifted into 0-dim CPU inputs) and runs a callback inside the backend,
where Dynamo's ``grapharg`` metadata still exists. :func:`build_fx_graph` builds the same kind of
chain directly with ``torch.fx`` (``to`` / ``orig_to`` with every device spelling, factories with
``device=cpu``), with fake ``example_value`` metadata like Dynamo's. A :class:`StacksSpec` describes a
model with several stacks of repeated blocks of different classes (:func:`build_stacks_model`).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from hypothesis import strategies as st
from torch import nn

#: Ops a chain may hold. Each maps ``x: (B, D) float32`` to the same shape.
OPS = (
    "linear",  # a parameter-using layer
    "embed",  # Embedding-like gather: x + W[ids]
    "index_select",  # x.index_select(0, perm.to(x.device))
    "gather",  # x.gather(1, gidx.to(x.device))
    "arange",  # x + torch.arange(D, device=x.device)
    "full",  # x + torch.full(x.shape, 0.5, device=x.device)
    "zeros",  # x + torch.zeros(D, device=x.device)
    "scalar",  # x * self.scale (a Python float, lifted to a 0-dim CPU tensor, read with .item())
    "rms",  # RMSNorm with a lifted eps
    "cast16",  # x.to(torch.float16).to(torch.float32)
    "cast64",  # x.to(dtype=torch.float64).to(torch.float32)
    "buffer",  # x + a registered buffer
    "shared_t",  # x @ shared.t(): one weight used through a view in several blocks
)


@dataclass(frozen=True)
class ModelSpec:
    """A random model: op chains before, inside (repeated) and after a ModuleList of blocks."""

    dim: int
    batch: int
    vocab: int
    pre: tuple[str, ...]
    block: tuple[str, ...]
    n_blocks: int
    post: tuple[str, ...]
    tie_head: bool = False
    reuse_first_block: bool = False
    seed: int = 0


@st.composite
def model_specs(draw: st.DrawFn, *, min_blocks: int = 0, max_blocks: int = 4) -> ModelSpec:
    """Random :class:`ModelSpec` values (small sizes, so a trace takes well under a second)."""
    ops = st.sampled_from(OPS)
    return ModelSpec(
        dim=draw(st.sampled_from([4, 8])),
        batch=draw(st.integers(2, 5)),
        vocab=draw(st.integers(3, 9)),
        pre=tuple(draw(st.lists(ops, max_size=3))),
        block=tuple(draw(st.lists(ops, min_size=1, max_size=4))),
        n_blocks=draw(st.integers(min_blocks, max_blocks)),
        post=tuple(draw(st.lists(ops, max_size=3))),
        tie_head=draw(st.booleans()),
        reuse_first_block=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


class _Chain(nn.Module):
    """Runs a chain of ops; owns the parameters, buffers and float attributes they need."""

    def __init__(self, ops: Sequence[str], dim: int, vocab: int, shared: nn.Parameter, gen: torch.Generator) -> None:
        super().__init__()
        self.ops = tuple(ops)
        self.shared = [shared]  # a plain list: the shared weight is owned by the root module
        self.lins = nn.ModuleList()
        self.embs = nn.ModuleList()
        self.ws = nn.ParameterList()
        self.scales: list[float] = []
        for k, op in enumerate(ops):
            if op == "linear":
                lin = nn.Linear(dim, dim)
                with torch.no_grad():
                    lin.weight.copy_(torch.randn(dim, dim, generator=gen) / dim**0.5)
                    lin.bias.copy_(torch.randn(dim, generator=gen))
                self.lins.append(lin)
            elif op == "embed":
                emb = nn.Embedding(vocab, dim)
                with torch.no_grad():
                    emb.weight.copy_(torch.randn(vocab, dim, generator=gen))
                self.embs.append(emb)
            elif op == "rms":
                self.ws.append(nn.Parameter(1 + torch.rand(dim, generator=gen)))
            elif op == "scalar":
                self.scales.append(0.5 + float(torch.rand((), generator=gen)))
            elif op == "buffer":
                self.register_buffer(f"buf{k}", torch.randn(dim, generator=gen))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor, ids: torch.Tensor, perm: torch.Tensor, gidx: torch.Tensor) -> torch.Tensor:
        li = ei = wi = si = 0
        for k, op in enumerate(self.ops):
            if op == "linear":
                x = self.lins[li](x)
                li += 1
            elif op == "embed":
                x = x + self.embs[ei](ids)
                ei += 1
            elif op == "index_select":
                x = x.index_select(0, perm.to(x.device))
            elif op == "gather":
                x = x.gather(1, gidx.to(x.device))
            elif op == "arange":
                x = x + torch.arange(x.shape[-1], device=x.device).to(x.dtype)
            elif op == "full":
                x = x + torch.full(x.shape, 0.5, device=x.device)
            elif op == "zeros":
                x = x + torch.zeros(x.shape[-1], device=x.device)
            elif op == "scalar":
                x = x * self.scales[si]
                si += 1
            elif op == "rms":
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.ws[wi]
                wi += 1
            elif op == "cast16":
                x = x.to(torch.float16).to(torch.float32)
            elif op == "cast64":
                x = x.to(dtype=torch.float64).to(torch.float32)
            elif op == "buffer":
                x = x + getattr(self, f"buf{k}")
            elif op == "shared_t":
                x = x @ self.shared[0].t()
            else:  # pragma: no cover - the strategy only draws known ops
                raise ValueError(op)
        return x


class RandomModel(nn.Module):
    """The model a :class:`ModelSpec` describes."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(spec.seed)
        self.spec = spec
        self.shared = nn.Parameter(torch.randn(spec.dim, spec.dim, generator=gen) / spec.dim**0.5)
        self.emb = nn.Embedding(spec.vocab, spec.dim)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(spec.vocab, spec.dim, generator=gen))
        self.pre = _Chain(spec.pre, spec.dim, spec.vocab, self.shared, gen)
        self.layers = nn.ModuleList(
            _Chain(spec.block, spec.dim, spec.vocab, self.shared, gen) for _ in range(spec.n_blocks)
        )
        self.post = _Chain(spec.post, spec.dim, spec.vocab, self.shared, gen)
        self.head = nn.Linear(spec.dim, spec.vocab, bias=False)
        if spec.tie_head:
            self.head.weight = self.emb.weight  # tied embedding: one weight used first and last

    def forward(self, x: torch.Tensor, ids: torch.Tensor, perm: torch.Tensor, gidx: torch.Tensor) -> torch.Tensor:
        x = x + self.emb(ids)
        x = self.pre(x, ids, perm, gidx)
        for layer in self.layers:
            x = x + layer(x, ids, perm, gidx)
        if self.spec.reuse_first_block and len(self.layers):
            x = self.layers[0](x, ids, perm, gidx)
        x = self.post(x, ids, perm, gidx)
        return self.head(x)


def model_inputs(spec: ModelSpec) -> tuple[torch.Tensor, ...]:
    """Inputs for :class:`RandomModel`: activations, token ids, a row permutation and gather indices."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    return (
        torch.randn(spec.batch, spec.dim, generator=gen),
        torch.randint(0, spec.vocab, (spec.batch,), generator=gen),
        torch.randperm(spec.batch, generator=gen),
        torch.randint(0, spec.dim, (spec.batch, spec.dim), generator=gen),
    )


def build_model(spec: ModelSpec) -> RandomModel:
    """The eval-mode model for ``spec``."""
    return RandomModel(spec).eval()


# -- models with several stacks of repeated blocks --------------------------------------------------
#: Block classes a generated stack may hold: ``dual`` maps two streams ``(a, b)`` to two (Flux's double blocks,
#: returning a tuple), ``single`` and ``gated`` map one stream (the two streams concatenated, as Flux's single
#: blocks do). Every kind is its own class.
STACK_KINDS = ("dual", "single", "gated")
#: What runs between two stacks besides joining or parting the streams: ``norm`` and ``proj`` read weights.
GLUE_KINDS = ("none", "norm", "proj", "cast")


@dataclass(frozen=True)
class StackSpec:
    """One stack: its block kind, how many blocks, and what its blocks and the glue before it hold."""

    kind: str
    n_blocks: int
    #: Each block holds a ``ModuleList`` of two linears (a container nested in the block).
    nested: bool = False
    #: Each block reads the root's shared weight (one weight used by several units and stacks).
    shared: bool = False
    #: Glue before the stack (after the previous one, or after the embedding for the first).
    glue: str = "none"


@dataclass(frozen=True)
class StacksSpec:
    """A model of 1-3 stacks ``s0``, ``s1``, ... with glue around them; the head may be tied to the embedding."""

    dim: int
    batch: int
    vocab: int
    stacks: tuple[StackSpec, ...]
    tie_head: bool = False
    seed: int = 0


@st.composite
def stacks_specs(draw: st.DrawFn, *, max_stacks: int = 3, max_blocks: int = 3) -> StacksSpec:
    """Random :class:`StacksSpec` values (small sizes; two stacks may hold blocks of one class, as T5's do)."""
    kinds = draw(st.lists(st.sampled_from(STACK_KINDS), min_size=1, max_size=max_stacks))
    stacks = tuple(
        StackSpec(
            kind=kind,
            n_blocks=draw(st.integers(2, max_blocks)),
            nested=draw(st.booleans()),
            shared=draw(st.booleans()),
            glue=draw(st.sampled_from(GLUE_KINDS)),
        )
        for kind in kinds
    )
    return StacksSpec(
        dim=draw(st.sampled_from([4, 8])),
        batch=draw(st.integers(1, 3)),
        vocab=draw(st.integers(3, 9)),
        stacks=stacks,
        tie_head=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _linear(dim_in: int, dim_out: int, gen: torch.Generator, bias: bool = True) -> nn.Linear:
    lin = nn.Linear(dim_in, dim_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(dim_out, dim_in, generator=gen) / dim_in**0.5)
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(dim_out, generator=gen) / 4)
    return lin


class _BlockBase(nn.Module):
    """What every generated block may hold: a nested ``ModuleList`` and the root's shared weight."""

    def __init__(self, spec: StackSpec, dim: int, shared: nn.Parameter, gen: torch.Generator) -> None:
        super().__init__()
        self.parts = nn.ModuleList(_linear(dim, dim, gen) for _ in range(2)) if spec.nested else None
        self.shared = [shared] if spec.shared else []  # a plain list: the root owns the shared weight

    def extra(self, h: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            for part in self.parts:
                h = torch.tanh(part(h))
        if self.shared:
            h = h + h @ self.shared[0].t()
        return h


class DualBlock(_BlockBase):
    """Two streams in, two out (a tuple), like Flux's dual-stream blocks."""

    def __init__(self, spec: StackSpec, dim: int, shared: nn.Parameter, gen: torch.Generator) -> None:
        super().__init__(spec, dim, shared, gen)
        self.to_a = _linear(dim, dim, gen)
        self.to_b = _linear(dim, dim, gen)
        self.out = _linear(dim, dim, gen)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.extra(torch.tanh(self.to_a(a) + self.to_b(b)))
        return a + self.out(h), b + h


class SingleBlock(_BlockBase):
    """One stream: a residual MLP."""

    def __init__(self, spec: StackSpec, dim: int, shared: nn.Parameter, gen: torch.Generator) -> None:
        super().__init__(spec, dim, shared, gen)
        self.up = _linear(dim, 2 * dim, gen)
        self.down = _linear(2 * dim, dim, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.extra(self.down(torch.tanh(self.up(x))))


class GatedBlock(_BlockBase):
    """One stream: a gate."""

    def __init__(self, spec: StackSpec, dim: int, shared: nn.Parameter, gen: torch.Generator) -> None:
        super().__init__(spec, dim, shared, gen)
        self.gate = _linear(dim, dim, gen, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.extra(self.gate(x)))


_BLOCKS: dict[str, type[_BlockBase]] = {"dual": DualBlock, "single": SingleBlock, "gated": GatedBlock}


class _Glue(nn.Module):
    """Glue before a stack, applied to each stream: an RMS norm, a projection, or a dtype round trip."""

    def __init__(self, kind: str, dim: int, gen: torch.Generator) -> None:
        super().__init__()
        self.kind = kind
        self.eps = 1e-6
        self.weight = nn.Parameter(1 + torch.rand(dim, generator=gen)) if kind == "norm" else None
        self.proj = _linear(dim, dim, gen) if kind == "proj" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        if self.proj is not None:
            return self.proj(x)
        if self.kind == "cast":
            return x.to(torch.float16).to(torch.float32)
        return x


class StacksModel(nn.Module):
    """The model a :class:`StacksSpec` describes: embedding, stacks ``s0``, ``s1``, ... with glue, norm, head.

    Streams: ``a`` (tokens) and ``b`` (a projected context). A one-stream stack runs on ``cat([a, b])``
    (glue, as Flux joins its streams before the single blocks); a two-stream stack after one parts them again.
    """

    def __init__(self, spec: StacksSpec) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(spec.seed)
        d = spec.dim
        self.spec = spec
        self.shared = nn.Parameter(torch.randn(d, d, generator=gen) / d)
        self.embed = nn.Embedding(spec.vocab, d)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(spec.vocab, d, generator=gen))
        self.context = _linear(d, d, gen)
        for k, stack in enumerate(spec.stacks):
            # named attributes, not a list: a list of glue modules would be a stack of its own
            setattr(self, f"glue{k}", _Glue(stack.glue, d, gen))
            setattr(self, f"s{k}", nn.ModuleList(
                _BLOCKS[stack.kind](stack, d, self.shared, gen) for _ in range(stack.n_blocks)
            ))
        self.norm_out = _Glue("norm", d, gen)
        self.head = _linear(d, spec.vocab, gen, bias=False)
        if spec.tie_head:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        a = self.embed(ids)
        b = self.context(context)
        x: torch.Tensor | None = None  # the joined stream while one-stream stacks run
        for k, stack in enumerate(self.spec.stacks):
            glue = getattr(self, f"glue{k}")
            blocks = getattr(self, f"s{k}")
            if stack.kind == "dual":
                if x is not None:
                    a, b = x.chunk(2, dim=0)
                    x = None
                a, b = glue(a), glue(b)
                for block in blocks:
                    a, b = block(a, b)
            else:
                x = glue(torch.cat([a, b], dim=0) if x is None else x)
                for block in blocks:
                    x = block(x)
        out = a + b if x is None else x
        return self.head(self.norm_out(out))


def stacks_inputs(spec: StacksSpec) -> tuple[torch.Tensor, ...]:
    """Inputs for :class:`StacksModel`: token ids and a context."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    return (
        torch.randint(0, spec.vocab, (spec.batch,), generator=gen),
        torch.randn(spec.batch, spec.dim, generator=gen),
    )


def build_stacks_model(spec: StacksSpec) -> StacksModel:
    """The eval-mode model for ``spec``."""
    return StacksModel(spec).eval()


# -- Dynamo tracing ---------------------------------------------------------------------------------
def clone_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose graphs (nested ones too) can be rewritten without touching ``gm``.

    Node ``meta`` dicts are copied shallowly (values shared, so Dynamo's fake values stay the same objects).
    """
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = torch.fx.GraphModule(gm, graph)
    for name, child in gm.named_children():
        if isinstance(child, torch.fx.GraphModule):
            setattr(new, name, clone_graph_module(child))
    return new


@dataclass
class Trace:
    """What :func:`trace_with` captured: the graph Dynamo passed, its real inputs, and the callback result."""

    gm: torch.fx.GraphModule
    example_inputs: list[Any]
    pristine: torch.fx.GraphModule
    result: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def trace_with(
    model: nn.Module,
    inputs: Sequence[Any],
    callback: Callable[[torch.fx.GraphModule, list[Any]], Any] | None = None,
    *,
    dynamic: bool = True,
) -> Trace:
    """Trace ``model(*inputs)`` with Dynamo on CPU (one graph), calling ``callback(gm, inputs)`` inside the backend."""
    captured: list[Trace] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        pristine = clone_graph_module(gm)
        trace = Trace(gm=gm, example_inputs=list(example_inputs), pristine=pristine)
        if callback is not None:
            trace.result = callback(gm, trace.example_inputs)
        captured.append(trace)
        return pristine.forward

    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=True)
        with torch.no_grad():
            compiled(*inputs)
    finally:
        torch._dynamo.reset()
    assert len(captured) == 1, f"expected one graph, Dynamo produced {len(captured)}"
    return captured[0]


# -- inputs for running a rewritten graph -----------------------------------------------------------
def is_host_scalar_input(value: Any) -> bool:
    """A 0-dim CPU tensor that is not a parameter (a lifted Python scalar)."""
    return isinstance(value, torch.Tensor) and value.dim() == 0 and not isinstance(value, nn.Parameter)


def inputs_on(device: torch.device | str, example_inputs: Sequence[Any]) -> list[Any]:
    """``example_inputs`` moved to ``device`` the way the executor prepares them (host scalars stay on CPU)."""
    out: list[Any] = []
    for v in example_inputs:
        if isinstance(v, torch.Tensor) and not is_host_scalar_input(v):
            out.append(v.detach().to(device))
        elif isinstance(v, torch.SymInt):  # Dynamo hands the backend its symbols; a real call passes ints
            out.append(int(v.node.hint))
        else:
            out.append(v)
    return out


def fake_run_on(device: torch.device | str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Propagate fake inputs on ``device`` (host scalars on the CPU) through a copy of ``gm``; return the outputs.

    Fake tensors check devices strictly (unlike eager meta kernels, which let a CPU index meet a meta
    tensor), so this raises ``FakeTensorDeviceMismatchError`` wherever a CPU tensor is left behind.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True), static_shapes=True)
    fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in inputs_on(device, example_inputs)]
    copy = clone_graph_module(gm)
    for mod in all_graph_modules(copy):
        for node in mod.graph.nodes:
            node.meta.pop("unbacked_bindings", None)  # symbols of the tracing ShapeEnv, not of this one
    return FakeTensorProp(copy, mode).propagate(*fakes)


@contextlib.contextmanager
def orig_to_installed() -> Iterator[None]:
    """Give ``torch.Tensor`` an ``orig_to`` alias of ``to`` (what torch_musa keeps) for the block, if absent."""
    added = not hasattr(torch.Tensor, "orig_to")
    if added:
        torch.Tensor.orig_to = torch.Tensor.to  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if added:
            del torch.Tensor.orig_to  # type: ignore[attr-defined]


# -- raw FX graphs ----------------------------------------------------------------------------------
#: Ways a graph can spell "the CPU" in a ``.to`` call: (args after self, kwargs). ``"cpu:0"`` is left out
#: here because fake tensors keep ``cpu:0`` distinct from ``cpu`` during propagation; it has a unit test.
TO_SPELLINGS: tuple[tuple[tuple[Any, ...], dict[str, Any]], ...] = (
    ((torch.device("cpu"),), {}),
    (("cpu",), {}),
    ((), {"device": torch.device("cpu")}),
    ((torch.device("cpu"),), {"non_blocking": True}),
    ((), {"device": "cpu", "copy": True}),
    ((torch.device("cpu"), torch.int64), {}),
)

#: ``scalar_to``: the lifted host scalar goes through a ``.to(cpu)`` (any alias and spelling) before ``.item()``;
#: that ``.to`` must NOT be rewritten to the device (the scalar is read back on the host).
FX_OPS = ("linear", "index_select", "gather", "arange", "zeros", "full", "scalar", "scalar_to", "cast16", "embed")


@dataclass(frozen=True)
class FxSpec:
    """A raw FX chain: ops, per-op block index (None: outside blocks), and how each ``.to`` is spelled."""

    dim: int
    batch: int
    ops: tuple[str, ...]
    blocks: tuple[int | None, ...]
    to_alias: tuple[str, ...]
    to_spelling: tuple[int, ...]
    seed: int = 0


@st.composite
def fx_specs(draw: st.DrawFn) -> FxSpec:
    """Random :class:`FxSpec` values; ``.to`` calls use ``to`` or the MUSA ``orig_to`` alias."""
    n = draw(st.integers(1, 8))
    ops = tuple(draw(st.lists(st.sampled_from(FX_OPS), min_size=n, max_size=n)))
    n_blocks = draw(st.integers(0, 3))
    # block indices are non-decreasing through the chain (graph order is execution order)
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=n_blocks + 1, max_size=n_blocks + 1)))
    blocks: list[int | None] = []
    for i in range(n):
        inside = [b for b in range(n_blocks) if cuts[b] <= i < cuts[b + 1]]
        blocks.append(inside[0] if inside else None)
    return FxSpec(
        dim=draw(st.sampled_from([3, 4])),
        batch=draw(st.integers(2, 4)),
        ops=ops,
        blocks=tuple(blocks),
        to_alias=tuple(draw(st.lists(st.sampled_from(["to", "orig_to"]), min_size=n, max_size=n))),
        to_spelling=tuple(draw(st.lists(st.integers(0, len(TO_SPELLINGS) - 1), min_size=n, max_size=n))),
        seed=draw(st.integers(0, 2**16)),
    )


def build_fx_graph(spec: FxSpec) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The graph for ``spec`` built with ``torch.fx`` plus real inputs; metadata as Dynamo records it.

    Inputs: ``x``, ``perm``, ``gidx``, ``ids``, a lifted 0-dim float ``scale``, then one weight per op
    that needs one (``nn.Parameter``). Call inside :func:`orig_to_installed` when ``orig_to`` is used.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gen = torch.Generator().manual_seed(spec.seed)
    d, b = spec.dim, spec.batch
    graph = torch.fx.Graph()
    inputs: list[Any] = []

    def placeholder(name: str, value: Any) -> torch.fx.Node:
        inputs.append(value)
        return graph.placeholder(name)

    x = placeholder("x", torch.randn(b, d, generator=gen))
    perm = placeholder("perm", torch.randperm(b, generator=gen))
    gidx = placeholder("gidx", torch.randint(0, d, (b, d), generator=gen))
    ids = placeholder("ids", torch.randint(0, 5, (b,), generator=gen))
    scale = placeholder("scale", torch.tensor(0.75, dtype=torch.float64))
    weights: list[torch.fx.Node] = []
    for k, op in enumerate(spec.ops):
        if op == "linear":
            weights.append(placeholder(f"w{k}", nn.Parameter(torch.randn(d, d, generator=gen), requires_grad=False)))
        elif op == "embed":
            weights.append(placeholder(f"e{k}", nn.Parameter(torch.randn(5, d, generator=gen), requires_grad=False)))
    cpu_nodes: list[torch.fx.Node] = []
    wi = 0

    def to_cpu(src: torch.fx.Node, k: int) -> torch.fx.Node:
        args, kwargs = TO_SPELLINGS[spec.to_spelling[k]]
        node = graph.call_method(spec.to_alias[k], (src, *args), dict(kwargs))
        cpu_nodes.append(node)
        return node

    for k, op in enumerate(spec.ops):
        start = len(graph.nodes)
        if op == "linear":
            x = graph.call_function(torch._C._nn.linear, (x, weights[wi]))
            wi += 1
        elif op == "embed":
            x = graph.call_function(operator.add, (x, graph.call_function(torch.nn.functional.embedding,
                                                                          (ids, weights[wi]))))
            wi += 1
        elif op == "index_select":
            x = graph.call_method("index_select", (x, 0, to_cpu(perm, k)))
        elif op == "gather":
            x = graph.call_method("gather", (x, 1, to_cpu(gidx, k)))
        elif op == "arange":
            a = graph.call_function(torch.arange, (d,), {"device": torch.device("cpu"), "dtype": torch.float32})
            x = graph.call_function(operator.add, (x, a))
        elif op == "zeros":
            z = graph.call_function(torch.zeros, ((b, d),), {"device": torch.device("cpu")})
            x = graph.call_function(operator.add, (x, z))
        elif op == "full":
            f = graph.call_function(torch.full, ((d,), 0.25), {"device": "cpu"})
            x = graph.call_function(operator.add, (x, f))
        elif op == "scalar":
            item = graph.call_method("item", (scale,))
            x = graph.call_function(operator.mul, (x, item))
        elif op == "scalar_to":
            args, kwargs = TO_SPELLINGS[spec.to_spelling[k] % 5]  # spellings without a dtype
            item = graph.call_method("item", (graph.call_method(spec.to_alias[k], (scale, *args), dict(kwargs)),))
            x = graph.call_function(operator.mul, (x, item))
        elif op == "cast16":
            x = graph.call_method("to", (graph.call_method("to", (x, torch.float16)), torch.float32))
        block = spec.blocks[k]
        if block is not None:
            stack = {"blk": (f"L['self'].layers.{block}", nn.Module)}
            for node in list(graph.nodes)[start:]:
                node.meta["nn_module_stack"] = dict(stack)
    graph.output((x,))
    gm = torch.fx.GraphModule(nn.Module(), graph)

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True), static_shapes=True)
    fake_inputs = [mode.from_tensor(v) for v in inputs]
    FakeTensorProp(gm, mode).propagate(*fake_inputs)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta.pop("val")
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), inputs, strict=True):
        if isinstance(value, nn.Parameter):
            node.meta["example_value"] = nn.Parameter(node.meta["example_value"], requires_grad=False)
    return gm, inputs


def all_graph_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """``gm`` and every GraphModule nested in it."""
    return [m for _, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)]


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value`` (through tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in flat_tensors(v)]
    return []
