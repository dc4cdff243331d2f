"""Cache safety: Inductor's FX-graph cache and AOTAutograd's cache key on the ZenFlow passes, the owners'
config and the parameter ids baked into the graph.

All tests share one temporary TORCHINDUCTOR_CACHE_DIR (compiled C++ kernels are reused, compile results
are not unless the keys match) with both caches explicitly on.
"""

import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import fresh_cache

import zenflow_compile.backend  # noqa: F401  (registers the backend)
from zenflow_compile.backend import ZenFlowGraphPass
from zenflow_compile.config import ZenFlowConfig
from zenflow_compile.passes import ZenFlowPassContext
from zenflow_compile.runtime import registry


@pytest.fixture(scope="module", autouse=True)
def shared_fresh_cache():
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        yield os.environ["TORCHINDUCTOR_CACHE_DIR"]


class RecordingRuntime:
    def __init__(self, bucket_numel=25_000_000, **keys):
        self.config = ZenFlowConfig(**keys)
        self.bucket_numel = bucket_numel
        self.pids = []
        self.buckets = 0

    def take_grads(self, pids, grads, scores=None):
        self.pids.extend(pids)
        self.buckets += 1


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def own(model, runtime):
    return [registry.register_param(p, runtime) for p in model.parameters()]


def train_once(model, backend):
    """Compile from scratch (Dynamo reset), run forward + backward; return the cache counters."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend)
    compiled(torch.randn(4, 6)).pow(2).sum().backward()
    got = {"aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
           "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
           "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
           "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
           "grads": [p.grad is not None for p in model.parameters()]}
    for p in model.parameters():
        p.grad = None
    torch._dynamo.reset()
    return got


def test_warm_inductor_cache_never_serves_a_graph_without_the_passes():
    model, runtime = mlp(), RecordingRuntime()
    pids = own(model, runtime)

    plain = train_once(model, "inductor")
    assert plain["aot_miss"] == 1 and plain["grads"] == [True] * 4 and runtime.pids == []

    # Same graph, warm cache: the zenflow compile must not be served the plain graph.
    first = train_once(model, "zenflow")
    assert first["aot_hit"] == 0 and first["aot_miss"] == 1 and first["fx_hit"] == 0
    assert first["grads"] == [False] * 4 and sorted(runtime.pids) == sorted(pids)

    # Same config, same ids: a recompile is served from the cache, and the cached graph still hands off.
    runtime.pids.clear()
    again = train_once(model, "zenflow")
    assert again["aot_hit"] == 1 and again["aot_miss"] == 0
    assert again["grads"] == [False] * 4 and sorted(runtime.pids) == sorted(pids)

    # And the other way round: plain Inductor gets its own (pass-free) graph back.
    runtime.pids.clear()
    plain_again = train_once(model, "inductor")
    assert plain_again["aot_hit"] == 1 and plain_again["grads"] == [True] * 4 and runtime.pids == []


def test_another_config_never_reuses_a_cached_graph():
    model, runtime = mlp(), RecordingRuntime(topk_ratio=0.3)  # a config no other test compiles with
    pids = own(model, runtime)
    assert train_once(model, "zenflow")["aot_miss"] == 1
    assert train_once(model, "zenflow")["aot_hit"] == 1

    runtime.config = ZenFlowConfig(topk_ratio=0.2)  # same parameters, other settings
    other = train_once(model, "zenflow")
    assert other["aot_hit"] == 0 and other["aot_miss"] == 1 and other["fx_hit"] == 0
    assert sorted(set(runtime.pids)) == sorted(pids)


def test_another_bucket_size_never_reuses_a_cached_graph():
    """The bucket size (the owners' reduce_bucket_size) shapes the rewritten graph: one hand-off op per bucket."""
    model, runtime = mlp(), RecordingRuntime(topk_ratio=0.35)  # a config no other test compiles with
    pids = own(model, runtime)
    assert train_once(model, "zenflow")["aot_miss"] == 1 and runtime.buckets == 1
    assert train_once(model, "zenflow")["aot_hit"] == 1

    runtime.bucket_numel, runtime.buckets = 1, 0  # same parameters and config, a bucket per gradient
    other = train_once(model, "zenflow")
    assert other["aot_hit"] == 0 and other["aot_miss"] == 1 and other["fx_hit"] == 0
    assert runtime.buckets == len(pids) and sorted(set(runtime.pids)) == sorted(pids)
    runtime.buckets = 0
    assert train_once(model, "zenflow")["aot_hit"] == 1 and runtime.buckets == len(pids)


def test_a_new_owner_reuses_the_cached_graph_and_gets_the_gradients():
    """The rewritten graph holds slots, not ids: a new optimizer over the same program shares its compiled
    graph, and the gradients follow the tensors to their new owner."""
    model = mlp()
    old = RecordingRuntime(topk_ratio=0.4)
    old_pids = own(model, old)
    train_once(model, "zenflow")
    assert sorted(old.pids) == sorted(old_pids)

    for pid in old_pids:  # what deleting the old optimizer does
        registry.unregister_param(pid)
    new = RecordingRuntime(topk_ratio=0.4)
    new_pids = own(model, new)
    assert set(new_pids).isdisjoint(old_pids)
    old.pids.clear()
    result = train_once(model, "zenflow")
    assert result["aot_hit"] == 1 and result["aot_miss"] == 0
    assert sorted(new.pids) == sorted(new_pids) and old.pids == []


def test_same_program_in_a_new_process_hits_the_cache(shared_fresh_cache):
    """The graph depends on the program and config only, so a re-run of a program reuses its cache entries."""
    script = textwrap.dedent("""
        import torch
        from torch._dynamo.utils import counters
        import zenflow_compile
        from zenflow_compile.backend import zenflow_backend
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.5, update_interval=2)
        compiled = torch.compile(model, backend=zenflow_backend)
        for step in range(2):
            compiled(torch.randn(4, 6)).pow(2).sum().backward()
            assert all(p.grad is None for p in model.parameters())
            opt.step()
            opt.zero_grad()
        print("RESULT", counters["aot_autograd"]["autograd_cache_hit"],
              counters["aot_autograd"]["autograd_cache_miss"], opt.stats()["steps"])
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=shared_fresh_cache, TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1")

    def run():
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT"))
        return tuple(int(v) for v in line.split()[1:])

    assert run() == (0, 1, 2)
    assert run() == (1, 0, 2)


# ------------------------------------------------------------------------------------ the passes' source
# pyproject maps passes/, runtime/ and triton_kernels/ into the package; a copy laid out as installed, run from
# its own folder, is imported ahead of the editable install.
INSTALLED_PACKAGES = ("zenflow_compile", "zenflow_compile.passes", "zenflow_compile.runtime",
                      "zenflow_compile.triton_kernels")

PRINT_UUID = textwrap.dedent("""
    import sys
    import zenflow_compile.backend as backend
    from zenflow_compile.passes import ZenFlowPassContext
    assert backend.__file__.startswith(sys.argv[1]), backend.__file__
    print(backend.ZenFlowGraphPass(ZenFlowPassContext(((2, 2), None))).uuid())
""")


def installed_copy(dest: Path) -> Path:
    for name in INSTALLED_PACKAGES:
        source = Path(importlib.import_module(name).__file__).parent
        shutil.copytree(source, dest.joinpath(*name.split(".")), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def uuid_in_a_new_process(package_root: Path) -> str:
    # run from the copy: `python -c` puts the working directory first on sys.path, and a checkout's has the package
    result = subprocess.run([sys.executable, "-c", PRINT_UUID, str(package_root)], capture_output=True,
                            text=True, cwd=package_root, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()[-1]


def test_editing_a_pass_changes_the_cache_key(tmp_path):
    """Any edit of a pass module (even a comment: the key cannot tell), or a new one, gives the pass another
    `uuid()`, so neither cache serves a graph that the old passes rewrote."""
    root = installed_copy(tmp_path)
    passes = root / "zenflow_compile" / "passes"
    unchanged = uuid_in_a_new_process(root)
    assert unchanged == ZenFlowGraphPass(ZenFlowPassContext(((2, 2), None))).uuid()  # the copy hashes alike

    handoff = passes / "grad_handoff.py"
    handoff.write_text(handoff.read_text() + "\n# an edit\n")
    edited = uuid_in_a_new_process(root)
    (passes / "another_pass.py").write_text('"""A pass added later."""\n')
    added = uuid_in_a_new_process(root)
    assert len({unchanged, edited, added}) == 3


class CountingPass(CustomGraphPass):
    """A user's post-grad pass: counts the graphs it saw; its uuid is part of Inductor's cache key."""

    def __init__(self, tag: str):
        self.tag, self.graphs = tag, 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1

    def uuid(self) -> str:
        return self.tag


@pytest.mark.parametrize("torch_211", [False, True], ids=["list-of-passes", "one-pass-setting"])
def test_a_users_post_grad_pass_runs_before_ours(torch_211, monkeypatch):
    """A post-grad pass the user installed keeps running, ours after it, on a torch whose setting takes a list
    of passes and on 2.11's, which takes one (the backend chains them); the cache keys on both."""
    if torch_211:
        monkeypatch.setattr(zenflow_compile.backend, "get_custom_graph_passes", None)
    user_pass = CountingPass(f"user-{torch_211}")
    runtime = RecordingRuntime()
    model = mlp()
    own(model, runtime)
    with torch._inductor.config.patch(post_grad_custom_post_pass=user_pass):
        got = train_once(model, "zenflow")
    assert user_pass.graphs == 2  # forward and backward
    assert runtime.pids and got["grads"] == [False] * 4  # ours ran: the gradients went to the runtime
    if torch_211:  # the one pass in the setting keys the cache on every pass in it, or bypasses it
        chain = zenflow_compile.backend._PassChain
        a_b, a_c = chain((CountingPass("a"), CountingPass("b"))), chain((CountingPass("a"), CountingPass("c")))
        assert a_b.uuid() != a_c.uuid()
        assert chain((lambda graph: None, CountingPass("b"))).uuid() is None
