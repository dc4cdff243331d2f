"""See what the `zenflow` backend does to backward graphs.

From Python:

    with zenflow_compile.inspect.capture() as graphs:   # caches off inside, so every graph is rewritten
        loss = compiled_model(x).sum()
        loss.backward()                                  # the backward compiles lazily, here
    print(graphs[0].before_code)                         # AOTAutograd's backward graph
    print(graphs[0].after_code)                          # after the ZenFlow passes
    graphs[0].after                                      # a torch.fx.GraphModule

`backward_graphs()` returns the most recent rewrites of the process (bounded history).

Elsewhere:
- `TORCH_TRACE=/some/dir` then `tlparse /some/dir/<log>`: artifacts `zenflow_backward_before` and
  `zenflow_backward_after` under each backward compile.
- `TORCH_LOGS="post_grad_graphs"`: the rewritten graph in the logs; `TORCH_LOGS="+zenflow_compile"`: notes.
- `options={"debug_dir": d}` or `ZENFLOW_DEBUG_DIR=d`: readable `<name>_before.py` / `<name>_after.py` in d.

Rewrites only happen on a compile: a graph loaded from Inductor's or AOTAutograd's cache (already rewritten)
is not emitted again to `TORCH_TRACE` / `TORCH_LOGS`. `capture()` and `debug_dir` turn both caches off for
their compiles, so they always see the rewrite.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import itertools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping, Optional, Sequence

import torch
import torch.fx
from torch._logging import getArtifactLogger, trace_structured
from torch.fx._utils import lazy_format_graph_code

if TYPE_CHECKING:
    from zenflow_compile.passes.context import ZenFlowPassContext
    from zenflow_compile.passes.backward_graph import ParamGrad

__all__ = ["BackwardGraph", "capture", "backward_graphs", "readable", "normalize_code"]

graph_log = getArtifactLogger(__name__, "post_grad_graphs")

_HISTORY_LEN = 32
_history: "collections.deque[BackwardGraph]" = collections.deque(maxlen=_HISTORY_LEN)
_captures: list[list["BackwardGraph"]] = []
_sequence = itertools.count()


@dataclasses.dataclass
class BackwardGraph:
    """One backward graph, before and after the ZenFlow passes."""

    name: str  # e.g. "backward_0_0" (from the compile id), unique within the process
    compile_id: Optional[str]
    param_names: dict[int, str]  # slot (backward output index) of each handed-off gradient -> parameter name
    before: torch.fx.GraphModule
    after: torch.fx.GraphModule

    @property
    def before_code(self) -> str:
        return readable(self.before)

    @property
    def after_code(self) -> str:
        return readable(self.after)

    def normalized_after_code(self) -> str:
        """`after_code` with slots shown with their parameter names and comments dropped (stable across runs)."""
        return normalize_code(self.after_code, self.param_names)


def capture(*, disable_caches: bool = True) -> "contextlib.AbstractContextManager[list[BackwardGraph]]":
    """Collect the backward graphs rewritten inside the block (compile and run the backward inside it).

    With `disable_caches` (default) the FX-graph and AOTAutograd caches are off inside the block, so graphs
    are compiled, and therefore rewritten and seen, even when a warm cache holds them (compiled kernels are
    still reused).
    """
    return _capture(disable_caches)


@contextlib.contextmanager
def _capture(disable_caches: bool) -> Iterator[list[BackwardGraph]]:
    records: list[BackwardGraph] = []
    _captures.append(records)
    try:
        with contextlib.ExitStack() as stack:
            if disable_caches:
                import torch._functorch.config
                import torch._inductor.config

                stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
                stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
            yield records
    finally:
        _captures.remove(records)


def backward_graphs() -> list[BackwardGraph]:
    """The most recent backward graphs rewritten in this process, oldest first."""
    return list(_history)


def readable(gm: torch.fx.GraphModule, *, verbose: bool = False) -> str:
    """`print_readable` text; `verbose` adds strides and devices (as Inductor's own graph dumps)."""
    return gm.print_readable(print_output=False, include_stride=verbose, include_device=verbose)


_SLOT_LIST = re.compile(r"(torch\.ops\.zenflow\.\w+\.default\(.*, )\[([\d, ]*)\]\)")


def normalize_code(code: str, slot_names: Optional[Mapping[int, str]] = None) -> str:
    """Drop comment lines (source locations vary) and show each op's slots by parameter name:
    `[3, 4]` -> `slots[fc2.weight, fc2.bias]`."""

    def label(slot: str) -> str:
        return slot_names.get(int(slot), "?") if slot_names is not None else "?"

    def names(match: re.Match) -> str:
        slots = [slot for slot in match.group(2).split(",") if slot.strip()]
        return f"{match.group(1)}slots[{', '.join(label(slot) for slot in slots)}])"

    lines = []
    for line in code.splitlines():
        if line.strip().startswith("#"):
            continue
        lines.append(_SLOT_LIST.sub(names, line.rstrip()))
    return "\n".join(lines).strip("\n") + "\n"


# ------------------------------------------------------------------------------ used by the backend's pass
def snapshot(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A copy of `graph` as a GraphModule, unaffected by later rewrites (ours and Inductor's)."""
    owner = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
    return torch.fx.GraphModule(owner, copy.deepcopy(graph), class_name="GraphModule")


def record_backward(before: torch.fx.GraphModule, graph: torch.fx.Graph, ctx: "ZenFlowPassContext",
                    grads: Sequence["ParamGrad"],
                    *, debug_dir: Optional[str] = None) -> BackwardGraph:
    """Publish one rewrite: history, active captures, structured trace, artifact log, debug files."""
    after = snapshot(graph)
    compile_id = torch._guards.CompileContext.current_compile_id()
    compile_id = None if compile_id is None else str(compile_id)
    record = BackwardGraph(
        name=_unique_name(compile_id),
        compile_id=compile_id,
        param_names={g.slot: ctx.name(g.slot) for g in grads},
        before=before, after=after)
    _history.append(record)
    for records in _captures:
        records.append(record)

    for stage, gm in (("before", before), ("after", after)):
        trace_structured(
            "artifact",
            metadata_fn=lambda stage=stage: {"name": f"zenflow_backward_{stage}", "encoding": "string"},
            payload_fn=lambda gm=gm: readable(gm, verbose=True),
        )
    graph_log.debug("%s", lazy_format_graph_code("ZenFlow rewritten backward graph", after,
                                                 colored=True))
    if debug_dir:
        _dump(record, Path(debug_dir))
    return record


def _unique_name(compile_id: Optional[str]) -> str:
    # "backward_0_1" from compile id "0/1"; a process-wide sequence number where that is missing or taken
    seq = next(_sequence)
    name = "backward_" + (re.sub(r"[^0-9A-Za-z]+", "_", compile_id).strip("_") if compile_id else str(seq))
    return name if all(r.name != name for r in _history) else f"{name}_{seq}"


def _dump(record: BackwardGraph, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    names = ", ".join(f"{slot}={name}" for slot, name in record.param_names.items())
    header = f"# ZenFlow {record.name} (compile id {record.compile_id}); parameter slots: {names}\n"
    for stage, gm in (("before", record.before), ("after", record.after)):
        (directory / f"{record.name}_{stage}.py").write_text(header + readable(gm, verbose=True))
