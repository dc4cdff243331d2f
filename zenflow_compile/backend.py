"""The `zenflow` torch.compile backend: Inductor, with ZenFlow's rewrite of every backward graph.

    model = torch.compile(model, backend="zenflow")                       # found via entry point
    model = torch.compile(model, backend="zenflow", options={"topk_ratio": 0.05, "debug_dir": "zf"})

How it works:
- Dynamo hands the backend the graph and its example inputs (real tensors; with inlined nn.Modules, the
  parameters are graph inputs). The backend records which forward inputs are ZenFlow parameters (their
  *slots*, with shapes) in a `ZenFlowPassContext`. A parameter that requires grad with no owning
  ZenFlowAdamW is an error here. A parameter with a gradient hook of the user's (`register_hook`,
  `register_post_accumulate_grad_hook`) is left out: the graph returns its gradient, autograd runs the
  hooks and accumulates `.grad`, and `opt.step()` takes it from there, as eagerly.
- It then calls Inductor's `compile_fx` with our pass as `post_grad_custom_post_pass`. Inductor runs that
  hook on the forward graph and on the (lazily compiled) backward graph; `compile_fx` re-applies its
  `config_patches` around the backward compile, which a `with config.patch(...)` around this call would not.
  The pass leaves forward and inference graphs untouched and rewrites backward graphs (`passes/`).
- Dynamo reuses one compiled graph for every instance of a module class (its guards do not pin parameter
  identity), so the graph cannot know whose parameters it runs with. The backend returns a thin wrapper
  (`GraphOwnerBinding`) that, at each call, resolves the slots to the ids of the tensors it is called with
  and binds them to that call's autograd node (`registry.bind_param_ids`); the backward's hand-off ops read
  them back. Any number of models and optimizers share compiled graphs safely, with no recompilation.
- Caches: Inductor's FX-graph cache and AOTAutograd's cache both hash the pass's `uuid()`, which covers the
  source of the pass modules, the owners' ZenFlow configs, their hand-off bucket size (`reduce_bucket_size`)
  and data-parallel world size, and the parameter slots and shapes, so a cached graph compiled without the
  passes or for other settings is never reused.

Logs: `TORCH_LOGS="+zenflow_compile"` (human logs), `TORCH_LOGS="post_grad_graphs"` (rewritten graphs),
`TORCH_TRACE=dir` + tlparse (graphs before/after, see `zenflow_compile.inspect`).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import logging
import os
import re
import typing
import weakref
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

try:  # torch >= 2.12: a post-grad pass may be a list, and is told whether the graph is an inference graph
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as _PostGradPass
    from torch._inductor.custom_graph_pass import get_custom_graph_passes
except ImportError:  # torch 2.11: one pass, called with the graph alone
    _PostGradPass, get_custom_graph_passes = CustomGraphPass, None

# By module path: `from zenflow_compile import inspect` would read the package, which is still running its
# __init__ (that imports this module): an import loop.
import zenflow_compile.inspect as zf_inspect
from zenflow_compile.config import ZENFLOW_KEYS, ZenFlowConfig, unknown_key_hints
from zenflow_compile.grad_hooks import any_user_grad_hooks, user_grad_hooks
from zenflow_compile.passes.backward_graph import graph_outputs, is_backward_graph
from zenflow_compile.passes.context import DEFAULT_BUCKET_NUMEL, ZenFlowPassContext
from zenflow_compile.passes.pipeline import rewrite_backward
from zenflow_compile.runtime import registry, sharding
from zenflow_compile.runtime.state.layout import SHARED_SLAB_MAX_NUMEL

__all__ = ["zenflow_backend", "ZenFlowGraphPass", "GraphOwnerBinding", "make_pass_context", "register",
           "BACKEND_NAME"]

log = logging.getLogger(__name__)

BACKEND_NAME = "zenflow"
DEBUG_DIR_ENV = "ZENFLOW_DEBUG_DIR"
_BACKEND_OPTIONS = ("debug_dir",)


# ------------------------------------------------------------------------------------------------ the pass
def _source_files() -> tuple[Path, ...]:
    """The code that decides what a rewritten graph looks like."""
    here = Path(__file__).resolve().parent
    import zenflow_compile.passes as passes_pkg
    import zenflow_compile.runtime.ops as ops_module

    passes_dir = Path(passes_pkg.__file__).resolve().parent
    return (Path(__file__).resolve(), here / "config.py", Path(ops_module.__file__).resolve(),
            *sorted(passes_dir.glob("*.py")))


_source_hash: Optional[str] = None


def _pass_source_hash() -> str:
    global _source_hash
    if _source_hash is None:
        hasher = hashlib.sha256()
        for path in _source_files():
            hasher.update(path.name.encode())
            hasher.update(path.read_bytes())
        _source_hash = hasher.hexdigest()
    return _source_hash


class ZenFlowGraphPass(_PostGradPass):
    """Inductor post-grad hook: rewrite backward graphs, leave forward and inference graphs alone.

    Picklable and self-contained (no live tensors), so it also works when Inductor compiles in a subprocess.
    """

    def __init__(self, ctx: ZenFlowPassContext, debug_dir: Optional[str] = None):
        self.ctx = ctx
        self.debug_dir = debug_dir

    def __call__(self, graph: torch.fx.Graph, is_inference: bool = False) -> None:
        if is_inference or not is_backward_graph(graph):
            return
        if len(graph_outputs(graph)) != self.ctx.num_inputs:
            # Not the top-level backward of our forward (e.g. a higher-order op's subgraph). Leaving it
            # unchanged is safe: gradients it returns reach the runtime through the optimizer's hooks.
            log.warning("ZenFlow: left a backward (sub)graph with %d outputs unchanged (forward has %d inputs)",
                        len(graph_outputs(graph)), self.ctx.num_inputs)
            return
        before = zf_inspect.snapshot(graph)
        grads = rewrite_backward(graph, self.ctx)
        log.info("ZenFlow: rewrote a backward graph: %d parameter gradient(s) handed to the runtime",
                 len(grads))
        zf_inspect.record_backward(before, graph, self.ctx, grads, debug_dir=self.debug_dir)

    def uuid(self) -> str:
        hasher = hashlib.sha256()
        hasher.update(_pass_source_hash().encode())
        hasher.update(repr(self.ctx.cache_key()).encode())
        return hasher.hexdigest()


# --------------------------------------------------------------------------------------------- the backend
def zenflow_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                    options: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None, **keys: Any):
    """torch.compile backend. `options` (or keyword arguments) may hold ZenFlow config keys (checked
    against the owning optimizer's config), `debug_dir`, and Inductor config keys (passed to Inductor)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    zenflow_keys, backend_opts, inductor_patches = _split_options({**(options or {}), **keys})
    debug_dir = backend_opts.get("debug_dir") or os.environ.get(DEBUG_DIR_ENV) or None
    ctx = make_pass_context(gm, example_inputs, zenflow_keys)
    graph_pass = ZenFlowGraphPass(ctx, debug_dir=None if debug_dir is None else os.fspath(debug_dir))
    patches: dict[str, Any] = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    patches.update(inductor_patches)
    caches = contextlib.nullcontext()
    if debug_dir is not None:
        # The rewrite, and so its dump, happens only when a backward is compiled: a graph served by the
        # FX-graph or AOTAutograd cache would leave the directory empty without a word. (The FX-graph cache
        # is patched for the lazily compiled backward too: compile_fx re-applies its patches there.)
        patches["fx_graph_cache"] = False
        import torch._functorch.config as functorch_config

        caches = functorch_config.patch(enable_autograd_cache=False)
    # Keep any post-grad pass the user installed; ours runs last.
    patches["post_grad_custom_post_pass"] = _after_user_passes(
        patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass), graph_pass)
    log.debug("ZenFlow: compiling a graph with %d ZenFlow parameter input(s)",
              sum(shape is not None for shape in ctx.param_shapes))
    cache_hits = _aot_cache_hits()
    with caches:
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    if _aot_cache_hits() > cache_hits:
        _note_cached_rewrite()
    tensor_inputs = tuple(isinstance(value, torch.Tensor) for value, _ in _forward_inputs(gm, example_inputs))
    return GraphOwnerBinding(compiled, gm, ctx, tensor_inputs)


def _after_user_passes(user_pass, graph_pass: ZenFlowGraphPass):
    """The post-grad pass setting that runs the user's passes, then ours."""
    if not user_pass:
        return graph_pass
    if get_custom_graph_passes is not None:
        return [*get_custom_graph_passes(user_pass), graph_pass]
    return _PassChain((*(user_pass if isinstance(user_pass, (list, tuple)) else (user_pass,)), graph_pass))


class _PassChain(CustomGraphPass):
    """Several post-grad passes as one, for a torch whose setting holds a single pass (2.11). Cacheable only
    when every pass in it is (a plain function has no uuid: Inductor then bypasses its cache, as for the
    function alone)."""

    def __init__(self, passes: Sequence[Any]):
        self.passes = tuple(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> Optional[str]:
        uuids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes]
        return None if None in uuids else hashlib.sha256(repr(uuids).encode()).hexdigest()


def _aot_cache_hits() -> int:
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"]


def _note_cached_rewrite() -> None:
    """A graph served by AOTAutograd's cache comes with its backward already rewritten: the pass does not run,
    so nothing reaches TORCH_LOGS / TORCH_TRACE. Say so, loudly when the user asked to see the graphs."""
    from torch._logging._internal import log_state, trace_log

    wants_graphs = (bool(trace_log.handlers) or log_state.is_artifact_enabled("post_grad_graphs")
                    or zf_inspect.graph_log.isEnabledFor(logging.DEBUG))
    (log.warning if wants_graphs else log.info)(
        "ZenFlow: this graph's forward and backward were loaded from AOTAutograd's cache, already rewritten "
        "when first compiled, so the rewrite is not logged or traced again (TORCH_LOGS=post_grad_graphs, "
        "TORCH_TRACE). To see it: TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, options={'debug_dir': d}, or "
        "zenflow_compile.inspect.capture()")


class GraphOwnerBinding:
    """A compiled graph that, at each call, binds its parameter slots to the ids of the tensors it runs with.

    The backward of that call hands each gradient to the owner of the tensor that was in the slot
    (`registry.accumulate_grads_from_graph`). Resolution is cached on tensor identity and the registry's
    generation, so a training loop pays one identity check per parameter per call.
    """

    def __init__(self, compiled, gm: torch.fx.GraphModule, ctx: ZenFlowPassContext,
                 tensor_inputs: Optional[Sequence[bool]] = None):
        self.compiled = compiled
        self.ctx = ctx
        # The autograd node of a call has one edge per tensor forward input (none for SymInts): the edge of
        # each parameter slot tells its backward whether the parameter's gradient is wanted
        # (`registry.bind_param_ids`).
        self._edges = None if tensor_inputs is None else _edge_indices(tensor_inputs)
        # AOTAutograd's forward inputs: the module's own parameters and buffers (when not inlined), then
        # the graph's inputs (see _forward_inputs).
        attrs = [t for _, t in gm.named_parameters(remove_duplicate=False)]
        attrs += [t for _, t in gm.named_buffers(remove_duplicate=False)]
        num_attrs = len(attrs)
        self._attr_params = {slot: attrs[slot] for slot in range(num_attrs) if ctx.is_param(slot)}
        self._arg_slots = [(slot, slot - num_attrs) for slot in range(num_attrs, ctx.num_inputs)
                           if ctx.is_param(slot)]
        self._cached_ids: Optional[tuple] = None
        self._cached_for: list = []  # weak references to the tensors the cached ids were resolved for
        self._cached_generation = -1

    def _refuse_late_hooks(self, slot_tensors: list[torch.Tensor]) -> None:
        slot, tensor = next((slot, t) for slot, t in zip(self._slots, slot_tensors) if user_grad_hooks(t))
        raise RuntimeError(
            f"backend='zenflow': parameter {self.ctx.name(slot)} (shape {tuple(tensor.shape)}) has a gradient "
            f"hook ({user_grad_hooks(tensor)}) that it did not have when this graph was compiled, so the graph "
            "hands its gradient to ZenFlowAdamW directly and the hook would get None. (A graph is compiled "
            "once per module class: another model of the class may have had no hook.) Fix: register the hook "
            "before the first call of the compiled model, or call torch._dynamo.reset() after registering it: "
            "the recompiled graph then passes this parameter's gradient through autograd, its hooks and "
            ".grad, and opt.step() takes it from there")

    def __call__(self, *args):
        # (The call's tensors are not kept: a deleted model's parameters must be freed with it.)
        slot_tensors = [*self._attr_params.values(), *(args[i] for _, i in self._arg_slots)]
        param_ids = self._param_ids(args)
        if any_user_grad_hooks(slot_tensors):
            self._refuse_late_hooks(slot_tensors)
        outputs = self.compiled(*args)
        registry.bind_param_ids(outputs, param_ids, self._edges, self.ctx.param_names)
        return outputs

    def _param_ids(self, inputs) -> tuple:
        tensors = [inputs[i] for _, i in self._arg_slots]
        if (self._cached_generation == registry.generation() and len(tensors) == len(self._cached_for)
                and all(ref() is t for ref, t in zip(self._cached_for, tensors))):
            return self._cached_ids
        ids: list[Optional[int]] = [None] * self.ctx.num_inputs
        for slot, tensor in [*self._attr_params.items(), *((s, inputs[i]) for s, i in self._arg_slots)]:
            ids[slot] = registry.param_id(tensor)
            if ids[slot] is None and _needs_owner(tensor):
                raise ValueError(_unowned_message(self.ctx.name(slot), tensor))
        self._check_handoff_settings(ids)
        self._cached_ids, self._cached_generation = tuple(ids), registry.generation()
        self._cached_for = [weakref.ref(t) for t in tensors]
        return self._cached_ids

    def _check_handoff_settings(self, ids: list[Optional[int]]) -> None:
        """The graph hands gradients over as its owners at compile time did (bucket size, and in data parallel
        the reduction): the owners of the tensors it now runs with must do the same."""
        runtimes = {id(r): r for r in (registry.runtime_of(pid) for pid in ids if pid is not None) if r is not None}
        if not runtimes:
            return
        now, compiled_for = _handoff_settings(runtimes.values()), (self.ctx.data_parallel, self.ctx.bucket_numel)
        if now != compiled_for:
            raise ValueError(
                f"backend='zenflow': this compiled graph hands gradients over as its optimizers did when it was "
                f"compiled, {_handoff_words(compiled_for)}, but the ZenFlowAdamW owning the parameters it now runs "
                f"with uses {_handoff_words(now)}. (A graph is compiled once per module class: another model of the "
                "class compiled it.) Fix: give the optimizers the same reduce_bucket_size and process_group, or "
                "call torch._dynamo.reset() before the first call of this model so that its graph is compiled "
                "for its own optimizer")

    @property
    def _slots(self) -> list[int]:
        return [*self._attr_params, *(slot for slot, _ in self._arg_slots)]


def _edge_indices(tensor_inputs: Sequence[bool]) -> tuple[Optional[int], ...]:
    """Per forward input, its edge in the call's autograd node (tensors only, in order), None for others."""
    edges, count = [], 0
    for is_tensor in tensor_inputs:
        edges.append(count if is_tensor else None)
        count += bool(is_tensor)
    return tuple(edges)


def _split_options(opts: Mapping[str, Any]) -> tuple[dict, dict, dict]:
    from torch._inductor import config as inductor_config

    inductor_keys = inductor_config.get_config_copy().keys()
    zenflow, backend, inductor = {}, {}, {}
    for key, value in opts.items():
        name = key.replace("-", "_")  # (torch.compile's own spelling rule for option keys)
        if key in ZENFLOW_KEYS:
            zenflow[key] = value
        elif name in _BACKEND_OPTIONS:
            if name == "debug_dir" and value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"backend='zenflow' option debug_dir={value!r} is invalid: expected a directory "
                                 "path (str or os.PathLike) to write the backward graphs to, or None")
            backend[name] = value
        elif name in inductor_keys:
            _check_inductor_option(inductor_config, name, value)
            inductor[name] = value
        else:
            hints = unknown_key_hints([key]) or _close_option(key, inductor_keys)
            raise ValueError(f"unknown option {key!r} for backend='zenflow'" + (f" ({hints})" if hints else "")
                             + f": expected a ZenFlowConfig key {list(ZENFLOW_KEYS)}, one of "
                             f"{list(_BACKEND_OPTIONS)}, or an Inductor config key")
    return zenflow, backend, inductor


def _close_option(key: str, inductor_keys) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), [*_BACKEND_OPTIONS, *inductor_keys], n=1, cutoff=0.8)
    return f"{key!r}: did you mean {close[0]!r}?" if close else ""


def _check_inductor_option(inductor_config, key: str, value: Any) -> None:
    """The type check `torch.compile(backend="inductor", options=...)` makes: Inductor's config patch would
    take any value, so `{"max_autotune": 3}` would otherwise be accepted here and refused there."""
    expected = inductor_config.get_type(key)
    if typing.get_origin(expected) is None and isinstance(expected, type) and not isinstance(value, expected):
        raise ValueError(f"backend='zenflow' Inductor option {key}={value!r} is invalid: expected a "
                         f"{expected.__name__} (Inductor's config type), got {type(value).__name__}")


def _forward_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[tuple[Any, str]]:
    """The forward graph's inputs as AOTAutograd orders them (module params, buffers, then graph inputs),
    each with a readable name."""
    inputs = [(p, name) for name, p in gm.named_parameters(remove_duplicate=False)]
    inputs += [(b, name) for name, b in gm.named_buffers(remove_duplicate=False)]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for i, value in enumerate(example_inputs):
        node = placeholders[i] if i < len(placeholders) else None
        inputs.append((value, _input_name(node) if node is not None else f"input {i}"))
    return inputs


def _input_name(node: torch.fx.Node) -> str:
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return node.name
    name = source.name if isinstance(source.name, str) else source.name()
    # L['self']._modules['fc1']._parameters['weight'] -> fc1.weight (the module's own naming)
    name = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", name)
    name = re.sub(r"^L\['([^']*)'\]", r"\1", name)
    return re.sub(r"^(?:self|fn)\.", "", name)


def make_pass_context(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                      zenflow_keys: Optional[Mapping[str, Any]] = None) -> ZenFlowPassContext:
    """Map the forward inputs of a Dynamo graph to ZenFlow parameter ids (by tensor identity).

    Raises ValueError for a trainable parameter no ZenFlowAdamW owns, and for `zenflow_keys` that are
    invalid or differ from an owning optimizer's config.
    """
    zenflow_keys = zenflow_keys or {}
    shapes, names, owners = [], [], {}
    for value, name in _forward_inputs(gm, example_inputs):
        pid = registry.param_id(value) if isinstance(value, torch.Tensor) else None
        if pid is None and _needs_owner(value):
            raise ValueError(_unowned_message(name, value))
        # (a hooked parameter's gradient goes through autograd and .grad: it is not handed over in the graph)
        handed_over = pid is not None and user_grad_hooks(value) is None
        shapes.append(tuple(value.shape) if handed_over else None)
        names.append(name)
        if pid is not None:
            runtime = registry.runtime_of(pid)
            owners.setdefault(id(runtime), runtime)
            check = getattr(runtime, "check_written_params", None)
            if check is not None:  # (a recompile after param.data was replaced lands here)
                check([value])
    if owners and _inside_distributed_data_parallel():
        raise ValueError(
            "backend='zenflow' compiled a model wrapped in torch.nn.parallel.DistributedDataParallel: the "
            "rewritten backward hands each gradient to ZenFlowAdamW before DDP could average it (a ZenFlowAdamW "
            "without a process group would train every rank on its own gradient). Fix: do not wrap the model "
            "in DDP; ZenFlowAdamW(model.parameters(), ...) under torch.distributed (process_group=None: the "
            "default group) averages the gradients across ranks inside the compiled backward itself")
    configs = [_owner_config(runtime) for runtime in owners.values()]
    _check_options(zenflow_keys, configs)
    data_parallel, bucket_numel = _handoff_settings(owners.values())
    return ZenFlowPassContext(
        param_shapes=tuple(shapes), param_names=tuple(names),
        configs=tuple(tuple(sorted(cfg.to_dict().items())) for cfg in configs),
        bucket_numel=bucket_numel, data_parallel=data_parallel,
        runtime_scored_numel=_runtime_scored_numel(owners.values()))


def _inside_distributed_data_parallel() -> bool:
    """Whether this graph is being compiled inside a DistributedDataParallel forward (Dynamo asks DDP the same)."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch built without distributed
        return False
    return getattr(DistributedDataParallel, "_get_active_ddp_module", lambda: None)() is not None


def _runtime_scored_numel(runtimes) -> int:
    """Gradients this small are scored by the runtime, batched with their like parameters (the owners'
    device decides: see `layout.SHARED_SLAB_MAX_NUMEL`); 0 when the owners have no device yet."""
    devices = {r.transfers.device.type for r in runtimes if getattr(r, "transfers", None) is not None}
    return min((SHARED_SLAB_MAX_NUMEL.get(device, 0) for device in devices), default=0)


def _handoff_settings(runtimes) -> tuple[Optional[int], int]:
    """(data-parallel world size or None, bucket elements) shared by the owners of one graph: the graph hands
    every gradient over the same way, in buckets of one size."""
    settings = {(None if getattr(r, "data_parallel", None) is None else r.data_parallel.world_size,
                 _owner_bucket_numel(r)) for r in runtimes}
    if len(settings) > 1:
        described = sorted(_handoff_words(s) for s in settings)
        raise ValueError("backend='zenflow': the ZenFlowAdamW optimizers owning this graph's parameters disagree "
                         f"on how gradients are handed over: {', '.join(described)}. One compiled graph hands "
                         "all its gradients over in buckets of one size. Fix: give them the same "
                         "reduce_bucket_size (and the same process_group)")
    return settings.pop() if settings else (None, DEFAULT_BUCKET_NUMEL)


def _handoff_words(settings: tuple[Optional[int], int]) -> str:
    world_size, bucket_numel = settings
    return f"(world size {world_size or 1}, reduce_bucket_size {bucket_numel})"


def _needs_owner(value: Any) -> bool:
    # Under no_grad no backward is built, so an un-owned parameter is harmless (e.g. eval-only compiles).
    if not (isinstance(value, torch.nn.Parameter) and value.requires_grad and torch.is_grad_enabled()):
        return False
    # FSDP2's unsharded parameter (what it all-gathers for the forward, not the registered DTensor): the graph
    # returns its gradient, FSDP2 reduce-scatters it into the sharded parameter's .grad, and step() takes that
    # as eagerly. It needs an owner of the sharded parameter.
    sharded_param = sharding.fsdp_sharded_param_of(value)
    return sharded_param is None or registry.param_id(sharded_param) is None


def _unowned_message(name: str, value: torch.Tensor) -> str:
    return (f"backend='zenflow': parameter {name} (shape {tuple(value.shape)}, dtype {value.dtype}) "
            "requires grad but no ZenFlowAdamW owns it (or it was removed from the optimizer's param_groups). "
            "Fix: create zenflow_compile.ZenFlowAdamW(model.parameters(), ...) covering every trainable "
            "parameter before calling the compiled model, or freeze it with requires_grad_(False).")


def _owner_bucket_numel(runtime: Any) -> int:
    bucket_numel = getattr(runtime, "bucket_numel", None)
    if not isinstance(bucket_numel, int):
        raise TypeError(f"ZenFlow runtime {type(runtime).__name__} has no int `.bucket_numel` (its hand-off "
                        "bucket size)")
    return bucket_numel


def _owner_config(runtime: Any) -> ZenFlowConfig:
    config = getattr(runtime, "config", None)
    if not isinstance(config, ZenFlowConfig):
        raise TypeError(f"ZenFlow runtime {type(runtime).__name__} has no ZenFlowConfig `.config`")
    return config


def _check_options(zenflow_keys: Mapping[str, Any], configs: Sequence[ZenFlowConfig]) -> None:
    """Backend options may restate ZenFlow keys; they must be valid and agree with every owner."""
    if not zenflow_keys:
        return
    if not configs:
        ZenFlowConfig.from_dict(zenflow_keys)  # still validate
        return
    for config in configs:
        merged = ZenFlowConfig.from_dict({**config.to_dict(), **zenflow_keys})
        for key in zenflow_keys:
            if getattr(merged, key) != getattr(config, key):
                raise ValueError(
                    f"backend='zenflow' option {key}={zenflow_keys[key]!r} differs from the owning "
                    f"ZenFlowAdamW's config ({key}={getattr(config, key)!r}); the optimizer's config is the "
                    f"one the runtime uses: set {key} on ZenFlowAdamW(...) or drop it from the options")


# ------------------------------------------------------------------------------------------ registration
def register() -> None:
    """Register the backend under its name; safe to call any number of times.

    When the package is installed, torch also finds it through the `torch_dynamo_backends` entry point; if
    torch has discovered that entry point but not loaded it yet, it is loading us right now (or will on
    the next lookup) and registers the backend itself, so registering here would be a duplicate.
    """
    from torch._dynamo.backends import registry as dynamo_registry

    if BACKEND_NAME in dynamo_registry._COMPILER_FNS:
        return
    if dynamo_registry._BACKENDS.get(BACKEND_NAME) is not None:
        return
    dynamo_registry.register_backend(zenflow_backend, name=BACKEND_NAME)


register()
