"""Trace an nn.Module's forward *and* backward into an `OpGraph`, without weights.

The model runs under `FakeTensorMode` (shapes only: no weight or activation
memory) with a `TorchDispatchMode` on top that records every aten op. That is
what `make_fx` does, minus building an FX graph we would not use: recording
directly keeps a 2-layer trace of a 405B-wide model well under a second.

- Module paths come from forward pre/post hooks (the nn_module_stack); ops of
  the backward pass are mapped to the module of the forward op whose autograd
  node runs them (through the autograd sequence number).
- Saved activations come from `saved_tensors_hooks`: each saved storage is
  counted once, on the op that produced it, and remembers which forward op
  saved it (so the layer that keeps it is known).
- FLOPs come from `torch.utils.flop_counter`'s formulas, plus the CPU flash
  attention ops that it does not cover (see `_sdpa_cpu_flops`).
"""
from __future__ import annotations

from typing import Any, Callable

import networkx as nx
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import flop_counter
from torch.utils.weak import WeakIdKeyDictionary

from hardware.errors import ModelError
from planner.executable import tp_split_classes
from planner.trace.graph import MATMUL_LIKE, OpGraph, new_node
from planner.trace.ops import (ALIASING, CUSTOM_FLOPS, DTYPES, FUSED_ATTENTION, PARAM_PRESERVING, Recorder, storage_key,
                               tensors)

aten = torch.ops.aten
class Tracer:
    """State of one trace: the graph and the tensor → node maps."""

    def __init__(self, graph: OpGraph, param_names: dict[int, str]) -> None:
        self.og = graph
        self.g: nx.DiGraph = graph.graph
        self.param_names = param_names  # id(param tensor) -> name
        self.param_of = WeakIdKeyDictionary()  # tensor (param or view/cast of one) -> name
        self.producer = WeakIdKeyDictionary()  # tensor -> node id
        self.storage_origin: dict[int, int] = {}  # storage key -> node that allocated it
        self.saved: set[int] = set()
        self.seen_params: set[str] = set()
        self.stack: list[str] = []
        self.phase = "forward"
        self.last_forward: int | None = None
        self.pending: list[tuple[torch.Tensor, str]] = []
        self.first_reader: dict[str, int] = {}
        self.seq_module: dict[int, str] = {}
        self.current_op = ""

    # -- module stack --------------------------------------------------------
    def hook(self, module: torch.nn.Module) -> list:
        handles = []
        for name, sub in module.named_modules():
            handles.append(sub.register_forward_pre_hook(lambda *_, n=name: self.stack.append(n)))
            handles.append(sub.register_forward_hook(lambda *_, n=name: self._pop(n)))
            self.og.module_types[name] = type(sub).__name__
            if isinstance(sub, tp_split_classes()):
                self.og.tp_split_modules.add(name)
        return handles

    def _pop(self, name: str) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()

    def module(self) -> str:
        if self.phase == "forward":
            return self.stack[-1] if self.stack else ""
        node = torch._C._current_autograd_node()
        return self.seq_module.get(node._sequence_nr(), "") if node is not None else ""

    # -- inputs and saved tensors -------------------------------------------
    def add_input(self, tensor: torch.Tensor, name: str) -> None:
        node = new_node(self.g, op=name, phase="input", kind="input", shape=tuple(tensor.shape),
                        dtype=str(tensor.dtype).replace("torch.", ""))
        self.producer[tensor] = node
        self.storage_origin[storage_key(tensor)] = node

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks pack: count each saved storage once, on its producer."""
        module = self.stack[-1] if self.stack else ""
        self.og.saves_by_module[module] = self.og.saves_by_module.get(module, 0) + 1  # every call: a recompute detaches each
        key = storage_key(tensor)
        node = self.storage_origin.get(key)
        if node is None or key in self.saved or tensor in self.param_of:
            return tensor
        self.saved.add(key)
        data = self.g.nodes[node]
        data["saved_bytes"] += tensor.untyped_storage().nbytes()
        data["saved_at"] = self.last_forward if self.last_forward is not None else node
        data["saved_module"] = module
        return tensor

    # -- op recording --------------------------------------------------------
    def record(self, func, args, kwargs, out) -> None:
        self._resolve_pending()
        ins, outs = tensors((args, kwargs)), tensors(out)
        packet = func._overloadpacket
        aliasing = func.is_view or packet in ALIASING or func._schema.is_mutable
        node = new_node(self.g, op=str(func), phase=self.phase, module=self.module())
        data = self.g.nodes[node]
        if outs:
            data["shape"], data["dtype"] = tuple(outs[0].shape), str(outs[0].dtype).replace("torch.", "")
        weights = self._link_inputs(node, ins)
        data["bytes"] = 0.0 if aliasing else float(sum(t.numel() * t.element_size() for t in ins + outs))
        data["flops"] = self._flops(func, args, kwargs, out, ins, data)
        data["kind"] = self._kind(packet, aliasing, data, weights, ins)
        if data["kind"] == "embedding":  # a gather reads the rows it returns, not the table
            data["bytes"] = float(sum(2 * t.numel() * t.element_size() for t in outs) + ins[1].numel() * 8)
        self._register_outputs(node, packet, aliasing, ins, outs)
        if self.phase == "forward":
            self.last_forward = node
            self.pending = [(t, data["module"]) for t in outs]

    def _link_inputs(self, node: int, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        """Add data edges; note parameters read (first read carries their bytes)."""
        data, weights, params = self.g.nodes[node], [], []
        for tensor in ins:
            src = self.producer.get(tensor)
            name = self.param_of.get(tensor) or self.param_names.get(id(tensor))
            if src is not None:
                self.g.add_edge(src, node, param=name is not None)
            if name is None:
                continue
            weights.append(tensor)
            params.append(name)
            if name not in self.seen_params and self.phase == "forward":
                self.seen_params.add(name)
                self.first_reader[name] = node
                data["param_bytes"] += tensor.numel() * tensor.element_size()
                data["param_count"] += tensor.numel()
            elif self.phase == "forward":  # a weight read again: tied, if another layer read it first
                data["rereads"] = (*data.get("rereads", ()), (name, tensor.numel(), self.first_reader.get(name)))
        data["params"] = tuple(params)
        return weights

    def _register_outputs(self, node, packet, aliasing, ins, outs) -> None:
        in_storages = {storage_key(t) for t in ins}
        param = next((self.param_of.get(t) or self.param_names.get(id(t)) for t in ins
                      if (self.param_of.get(t) or self.param_names.get(id(t)))), None)
        keep_param = param is not None and (aliasing or packet in PARAM_PRESERVING) and len(ins) == 1
        for tensor in outs:
            self.producer[tensor] = node
            key = storage_key(tensor)
            if key not in in_storages:
                self.storage_origin[key] = node
            if keep_param:
                self.param_of[tensor] = param

    def _flops(self, func, args, kwargs, out, ins, data) -> float:
        packet = func._overloadpacket
        formula = CUSTOM_FLOPS.get(packet) or flop_counter.flop_registry.get(packet)
        if formula is not None:
            return float(formula(*args, out_val=out, **kwargs))
        if not MATMUL_LIKE.search(str(func)):
            return 0.0
        self.og.warn_once(f"no FLOP formula for {func}: estimated from shapes as 2·out·k")
        big = [t for t in ins if t.dim() >= 2]
        if len(big) >= 2 and big[0].shape[-1] == big[1].shape[-2]:
            return 2.0 * data_numel(data["shape"]) * big[0].shape[-1]
        return 0.0

    def _kind(self, packet, aliasing, data, weights, ins) -> str:
        if aliasing:
            return "view"
        if packet in FUSED_ATTENTION:
            return "attention"
        if packet is aten.embedding and weights:
            return "embedding"
        if data["flops"] > 0 or MATMUL_LIKE.search(data["op"]):
            flat = [w for w in weights if w.dim() == 2]
            if flat and data["phase"] == "forward":
                data["weight_dims"] = tuple(flat[0].shape)
                return "linear"
            return "matmul" if data["flops"] > 0 else "elementwise"
        return "elementwise"

    def _resolve_pending(self) -> None:
        """Map the previous forward op's autograd node (now attached) to its module."""
        for tensor, module in self.pending:
            if tensor.grad_fn is not None:
                self.seq_module.setdefault(tensor.grad_fn._sequence_nr(), module)
        self.pending = []


def data_numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def _default_loss(output: Any, tokens: torch.Tensor | None) -> torch.Tensor:
    """A training-like scalar: cross-entropy over [b, s, V] logits, else a sum."""
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = next(t for t in tensors(output) if t.is_floating_point())
    if logits.dim() == 3 and tokens is not None and tokens.shape == logits.shape[:2]:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    return logits.float().sum()


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor as an uninitialised CPU one of its shape (a factory's module built on the
    meta device), so that its fake copy sits on the device the example inputs do."""
    if t.device.type != "meta":
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, requires_grad=t.requires_grad)


def _fake_state(module: torch.nn.Module, fake_mode: FakeTensorMode, dtype: torch.dtype) -> tuple[dict, dict]:
    """Fake copies of the parameters/buffers (ties kept), cast to the trace dtype."""
    fakes: dict[int, torch.Tensor] = {}
    state, names = {}, {}

    def fake(t: torch.Tensor, grad: bool) -> torch.Tensor:
        if id(t) not in fakes:
            src = t if isinstance(t, FakeTensor) else _on_cpu(t)
            f = src if isinstance(src, FakeTensor) else fake_mode.from_tensor(src)
            if f.is_floating_point() and f.dtype != dtype:
                f = f.to(dtype)
            fakes[id(t)] = f.detach().requires_grad_(grad) if grad and not f.requires_grad else f
        return fakes[id(t)]

    with fake_mode:
        for name, p in module.named_parameters(remove_duplicate=False):
            state[name] = fake(p, p.requires_grad)
            names.setdefault(id(state[name]), name)
        for name, b in module.named_buffers(remove_duplicate=False):
            state[name] = fake(b, False)
    return state, names


def trace_module(module: torch.nn.Module, example_inputs: tuple | dict, *, name: str | None = None,
                 seq_len: int | None = None, dtype: str = "bf16", fake_mode: FakeTensorMode | None = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 call_kwargs: dict[str, Any] | None = None) -> OpGraph:
    """Trace forward + backward of `module` on `example_inputs` (shapes only).

    `example_inputs` is a tuple of positional args or a dict of kwargs; real
    tensors are replaced by fake ones, so nothing is computed or allocated.
    `call_kwargs` are extra non-tensor forward arguments (e.g. use_cache=False);
    `loss_fn(output, tokens)` makes the scalar that backward starts from.
    Scaled-dot-product attention is traced as one fused kernel; a module that calls
    it is traced again with the calls on torch's math path (`OpGraph.math_path`,
    see `planner.trace.attention`). Raises `ModelError` naming the module and op
    when tracing fails.
    """
    args = (module, example_inputs, name, seq_len, dtype, loss_fn, call_kwargs)
    fake_mode = fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
    og = _trace_once(*args, fake_mode, "fused")
    split = (og.tp_module_styles,)  # a tuple: a None split (derivation failed) is kept, not derived again
    if og.attention_calls:
        og.math_path = _trace_once(*args, fake_mode, "math", split=split)
    if dtype in AUTOCAST_DTYPES:  # and over fp32 weights under autocast, on each attention path
        og.autocast_path = _trace_once(*args, fake_mode, "fused", split=split, weights=torch.float32)
        if og.attention_calls:
            og.autocast_path.math_path = _trace_once(*args, fake_mode, "math", split=split, weights=torch.float32)
    return og


AUTOCAST_DTYPES = ("bf16", "fp16")  # the half dtypes a plan may compute in under torch.autocast


def _trace_once(module, example_inputs, name, seq_len, dtype, loss_fn, call_kwargs, fake_mode, path,
                split=None, weights: torch.dtype | None = None) -> OpGraph:
    """One trace; with `weights` (fp32), the weights in that dtype and the run under
    torch.autocast in `dtype`, as the executor runs a plan over fp32 master weights."""
    from planner.trace.attention import sdpa_as
    from planner.trace.blocks import analyse

    state, names = _fake_state(module, fake_mode, weights or DTYPES.get(dtype, torch.bfloat16))
    with fake_mode:
        inputs = [_fake_input(fake_mode, t) for t in
                  (example_inputs.values() if isinstance(example_inputs, dict) else example_inputs)]
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    seq = seq_len or (int(first.shape[1]) if first is not None and first.dim() >= 2 else 1)
    batch = int(first.shape[0]) if first is not None and first.dim() >= 1 else 1
    og = OpGraph(nx.DiGraph(), name or type(module).__name__, seq_len=seq, batch=batch, dtype=dtype)
    tracer = Tracer(og, names)
    keys = list(example_inputs) if isinstance(example_inputs, dict) else None
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor):
            tracer.add_input(t, f"input:{keys[i] if keys else i}")
    handles = tracer.hook(module)
    record = lambda call: og.attention_calls.append({**call, "first_node": og.graph.number_of_nodes()})  # noqa: E731
    try:
        autocast = torch.autocast("cpu", dtype=DTYPES[dtype], enabled=weights is not None)
        with sdpa_as(path, record), autocast:
            _run(module, state, inputs, keys, tracer, fake_mode, loss_fn or _default_loss, call_kwargs or {})
    except ModelError:
        raise
    except Exception as error:  # noqa: BLE001 - any torch failure becomes one line
        raise _trace_error(error, tracer, og) from error
    finally:
        for handle in handles:
            handle.remove()
    if split is None:
        _derive_split(og, module, state, inputs, keys, fake_mode, call_kwargs or {})
    else:  # the math path's linears are the fused path's
        (og.tp_module_styles,) = split
    analyse(og)
    return og


def _derive_split(og: OpGraph, module, state, inputs, keys, fake_mode, extra) -> None:
    """The TP split as the executor derives it (`tp_styles.analyse_tp`), on a forward of the
    same fake weights and inputs; a model whose forward it cannot follow keeps the graph's own."""
    from planner.trace.tp_styles import analyse_tp

    args, kwargs = (inputs, {}) if keys is None else ((), dict(zip(keys, inputs)))

    def forward():
        return torch.func.functional_call(module, state, tuple(args), {**kwargs, **extra}, tie_weights=True,
                                          strict=False)

    try:
        with fake_mode:
            analysis = analyse_tp(module, forward=forward)
    except Exception as error:  # noqa: BLE001 - any torch failure: the graph's own split stands
        og.warn_once(f"the TP split was read from the traced graph, not the executor's derivation: "
                     f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}")
        return
    og.tp_module_styles = dict(analysis.styles)


def _fake_input(fake_mode: FakeTensorMode, value):
    """A fake copy of an example input, on the CPU: a module built on the meta device traces
    beside inputs made anywhere."""
    if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
        return value
    if value.device.type == "meta":  # made under fake_mode: a fake CPU tensor, nothing allocated
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    return fake_mode.from_tensor(value.to("cpu"))


def _run(module, state, inputs, keys, tracer, fake_mode, loss_fn, extra) -> None:
    args, kwargs = (inputs, {}) if keys is None else ((), dict(zip(keys, inputs)))
    kwargs = {**kwargs, **extra}
    tokens = next((t for t in inputs if isinstance(t, torch.Tensor) and not t.is_floating_point()), None)
    with fake_mode, Recorder(tracer):
        with torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t):
            output = torch.func.functional_call(module, state, tuple(args), kwargs, tie_weights=True, strict=False)
            loss = loss_fn(output, tokens)
        tracer._resolve_pending()
        tracer.phase = "backward"
        if loss.requires_grad:
            loss.backward()


def _trace_error(error: Exception, tracer: Tracer, og: OpGraph) -> ModelError:
    where = tracer.stack[-1] if tracer.stack else "<root>"
    kind = og.module_types.get(where, "")
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    return ModelError("model", f"cannot trace module {where!r} ({kind}) at op {tracer.current_op}: "
                               f"{type(error).__name__}: {first}",
                      "tracing runs on fake tensors: data-dependent Python control flow (.item(), "
                      "`if tensor:`) and ops without a fake implementation are not supported")
