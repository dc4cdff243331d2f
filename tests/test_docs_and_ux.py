"""The front door as documented: README's code runs as written, the names the docs give exist, and the mistakes
a new user makes (a misspelt key, an optimizer argument among the ZenFlow keys, a warm cache hiding the
rewrite) get a message that names the problem and the fix."""

from __future__ import annotations

import ast
import importlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import tokenize
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

import zenflow_compile
from zenflow_compile import ZenFlowAdamW, ZenFlowConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
ARCHITECTURE = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")

# What `pip install torch==2.13.0 -e .` does not install (the test, deepspeed and bench extras). Marking them
# absent in sys.modules makes any import of them fail as on a base install.
NOT_IN_BASE_INSTALL = ("triton", "transformers", "deepspeed", "accelerate", "expecttest", "tlparse", "pytest",
                       "matplotlib")


def _readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


# ----------------------------------------------------------------------------------------------- README
def test_readme_first_snippet_runs_as_written_on_a_base_install():
    """README's first Python block, verbatim, with an HF-style model (`model(**batch).loss`) and a loader defined
    around it, in a process where the extras are not importable; the trained weights equal ZenFlowReference's."""
    snippet = _readme_blocks("python")[0]
    assert 'torch.compile(model, backend="zenflow")' in snippet and "opt.synchronize()" in snippet
    program = f"""
import copy, json, sys, types
for name in {NOT_IN_BASE_INSTALL!r}:
    sys.modules[name] = None
import torch
import torch.nn.functional as F
from torch import nn
from zenflow_compile.reference import ZenFlowReference

class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 4)
    def forward(self, x, labels):
        return types.SimpleNamespace(loss=F.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), labels))

torch.manual_seed(0)
model = Classifier()
reference_model = copy.deepcopy(model)
initial = [p.detach().clone() for p in model.parameters()]
loader = [dict(x=torch.randn(8, 32), labels=torch.randint(0, 4, (8,))) for _ in range(9)]
# ---- README.md, first python block, as written
{snippet}
# ----
reference = ZenFlowReference(reference_model.parameters(), lr=2e-5, weight_decay=0.01)  # the defaults
for batch in loader:
    reference_model(**batch).loss.backward()
    reference.step()
    reference.zero_grad()
reference.synchronize()
params = list(model.parameters())
print(json.dumps(dict(
    diff=max((p - r).abs().max().item() for p, r in zip(params, reference_model.parameters())),
    moved=min((p - p0).abs().max().item() for p, p0 in zip(params, initial)),
    grads_none=all(p.grad is None for p in params),
    stats=sorted(opt.stats()),
    steps=opt.stats()["steps"])))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 9 and result["grads_none"]
    assert result["moved"] > 1e-5  # every parameter trained
    assert result["diff"] < 1e-6, result  # and exactly as the oracle of docs/semantics.md says

    # docs/stats.md's list of counters names keys that exist, and every key
    stats_page = (ROOT / "docs" / "stats.md").read_text(encoding="utf-8")
    bullet = re.search(r"- `opt\.stats\(\)`:(.*?)\n\n", stats_page, flags=re.S).group(1)
    documented = {k for k in re.findall(r"`([a-z_]+)`", bullet) if not k.startswith("_")}
    assert documented and documented <= set(result["stats"]), documented - set(result["stats"])
    undocumented = {k for k in result["stats"] if f"`{k}`" not in stats_page and not k.endswith("_per_step")}
    assert not undocumented, f"docs/stats.md does not name these opt.stats() keys: {sorted(undocumented)}"


def test_readme_first_command_pins_and_extras_exist():
    """The title comes first (no code block before it); lines 2 and 3 (an indented code block under it) are the
    base-install quick start and the test command that CI (.ci/run) runs; line 3 installs extras that
    pyproject.toml defines, and so does every other `pip install -e ".[...]"` of the README."""
    lines = README.splitlines()
    assert lines[0].startswith("# "), lines[0]
    assert lines[1].startswith("    ") and lines[2].startswith("    "), "lines 2-3: an indented code block"
    assert lines[1].strip().startswith("pip install torch==2.13.0 -e . && python examples/quickstart.py")
    assert "pytest" in lines[2]
    extras = re.search(r'-e "\.\[([\w,]+)\]"', lines[2]).group(1).split(",")
    extras += [e for group in re.findall(r'-e "\.\[([\w,]+)\]"', README) for e in group.split(",")]
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra in extras:
        assert re.search(rf"^{extra} = \[", pyproject, flags=re.M), f"README installs unknown extra {extra!r}"
    # torch imports numpy without requiring it ("Failed to initialize NumPy" on every run): the base install has it
    base = re.search(r"^dependencies = \[(.*?)\]", pyproject, flags=re.M | re.S).group(1)
    assert any(line.strip().startswith('"numpy') for line in base.splitlines()), base
    # the quick start imports nothing beyond the base install
    imports = re.findall(r"^(?:import|from) (\w+)", (ROOT / "examples/quickstart.py").read_text(), flags=re.M)
    assert set(imports) <= {"argparse", "time", "torch", "zenflow_compile"}, imports


def test_every_base_dependency_is_imported_by_the_package():
    """What a plain install pulls in, the package uses (numpy: torch's own need at import, above)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    base = re.search(r"^dependencies = \[(.*?)\]", pyproject, flags=re.M | re.S).group(1)
    names = {re.match(r'\s*"([\w-]+)', line).group(1) for line in base.splitlines() if line.strip()} - {"numpy"}
    sources = "\n".join(p.read_text() for d in ("zenflow_compile", "passes", "runtime", "triton_kernels")
                        for p in (ROOT / d).rglob("*.py"))
    unused = sorted(n for n in names if not re.search(rf"^\s*(?:import|from) {n}\b", sources, flags=re.M))
    assert not unused, f"declared in pyproject's dependencies but imported by no module of the package: {unused}"


def test_paths_named_in_the_docs_exist():
    docs = "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    named = set(re.findall(r"(?<![\w/])((?:examples|benchmarks|tests|zenflow_compile|runtime|passes|triton_kernels)"
                           r"/[\w/.-]+\.(?:py|json|png))", README + ARCHITECTURE + docs))
    assert len(named) > 20
    missing = sorted(p for p in named if not (ROOT / p).exists() and "*" not in p)
    assert not missing, f"README/ARCHITECTURE/docs name files that do not exist: {missing}"


def test_readme_stays_short_and_links_every_docs_page():
    """The README is a first hour's reading (at most 250 lines); the reference lives in docs/, and the README
    links every page there, each of which exists."""
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference into docs/"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", README))
    missing = sorted(p for p in linked if not (ROOT / p).is_file())
    assert not missing, f"README links docs pages that do not exist: {missing}"
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_pytest_m_cuda_selects_the_cuda_tests():
    """README: tests marked `cuda` run only where a GPU is present. `pytest -m cuda` selects them; without a GPU
    each is skipped with the reason, none fails."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda",
                           "tests/test_transfers.py", "tests/test_triton_kernels.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|error|deselected)", summary)}
    assert proc.returncode == 0, proc.stdout[-3000:]
    if torch.cuda.is_available():
        assert counts.get("passed", 0) > 20, summary
    else:
        assert counts.get("skipped", 0) > 20 and "passed" not in counts, summary
        assert "needs a CUDA device" in proc.stdout


def test_docs_and_docstrings_name_no_file_outside_the_repo():
    """What a user reads (README, docs/, ARCHITECTURE, benchmarks/README, the docstrings and comments of the
    package, examples and benchmarks) points only into the repository: no `../` paths, no team documents."""
    texts = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "benchmarks" / "README.md",
             *sorted((ROOT / "docs").glob("*.md"))]
    texts += [p for d in ("zenflow_compile", "passes", "runtime", "triton_kernels", "benchmarks", "examples")
              for p in sorted((ROOT / d).rglob("*.py"))]
    outside = re.compile(r"\.\./[\w./-]+|\bSPEC(?:\.md| §| section)|shared/SPEC")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in texts
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if outside.search(line)]
    assert not found, "\n".join(found)
    for link in re.findall(r"\]\(([^)#\s]+)", README):  # markdown links and images in the README
        assert link.startswith(("http://", "https://")) or (ROOT / link).exists(), link


# ------------------------------------------------------------------------------------------ ARCHITECTURE
def _definitions(path: Path, name: str) -> bool:
    text = path.read_text(encoding="utf-8")
    return re.search(rf"(?:def|class)\s+{re.escape(name)}\b|self\.{re.escape(name)}\b|^\s+{re.escape(name)}\s*[:=]"
                     rf"|^{re.escape(name)}\s*=", text, flags=re.M) is not None


def test_architecture_names_exist_where_it_says():
    sources = [p for d in ("zenflow_compile", "passes", "runtime", "triton_kernels") for p in (ROOT / d).rglob("*.py")]
    classes = {m: p for p in sources for m in re.findall(r"^class (\w+)", p.read_text(encoding="utf-8"), flags=re.M)}
    # `engine.x` in the docs is DeepSpeed's engine object, not runtime/engine.py
    modules = {p.stem: p for p in sources if p.stem not in ("engine", "__init__")}
    ops = (ROOT / "runtime/ops.py").read_text(encoding="utf-8")
    checked, stale = 0, []
    for token in sorted(set(re.findall(r"`([^`\s]+)`", ARCHITECTURE))):
        token = token.removesuffix("()")
        if token.startswith("zenflow::"):  # a custom op: `zenflow::accumulate_grads`
            checked += 1
            if not re.search(rf"\b{token.split('::')[1]}\b", ops):
                stale.append(token)
        elif "::" in token:  # `runtime/kernels.py::cpu_adamw_`
            path, name = token.split("::")
            checked += 1
            if not ((ROOT / path).exists() and _definitions(ROOT / path, name.split(".")[-1])):
                stale.append(token)
        elif token.endswith(".py"):
            continue  # file names: test_paths_named_in_the_docs_exist
        elif re.fullmatch(r"[A-Za-z_]\w*\.[A-Za-z_]\w*", token):  # `MatrixState.receive_grad`, `kernels.cpu_adamw_`
            owner, name = token.split(".")
            path = classes.get(owner) or modules.get(owner)
            if path is None:
                continue  # torch / deepspeed / user names (`opt.step`, `deepspeed.initialize`)
            checked += 1
            if not _definitions(path, name):
                stale.append(token)
        elif re.fullmatch(r"[A-Z]\w+", token) and token != "None":  # a class name
            checked += 1
            if token not in classes and not any(re.search(rf"\b{token}\b", p.read_text(encoding="utf-8"))
                                                for p in sources):
                stale.append(token)
    assert checked > 40
    assert not stale, f"ARCHITECTURE.md names what the code does not define: {stale}"


# ------------------------------------------------------------------------------ what the prose cites exists
PACKAGE_DIRS = ("zenflow_compile", "passes", "runtime", "triton_kernels")
REPO_DIRS = (*PACKAGE_DIRS, "tests", "benchmarks", "examples")
# Where a cited path may start (a file of the checkout); other roots (`deepspeed/runtime/...`, `torch/...`)
# name other projects' files.
PATH_ROOTS = (*REPO_DIRS, "docs", "integrations")
CITED_PATH = re.compile(r"(?<![\w/.<>*{}$-])((?:[\w-]+/)*[\w-]+\.(?:py|md|json|png))(?![\w/])")
BACKTICKED = re.compile(r"`+([^`\s]+?)`+")
# Module names the prose also uses for other things: DeepSpeed's engine, a Trainer's optimizer, Inductor's config,
# the libraries of the same name.
AMBIGUOUS_MODULES = {"engine", "optimizer", "config", "deepspeed", "transformers", "datasets", "inspect"}
# Environment variables and names of other projects that the prose cites in capitals.
EXTERNAL_CAPS_PREFIXES = ("TORCH", "TRITON", "CUDA", "OMP_", "NCCL", "PYTORCH", "TYPE_CHECKING")


def _python_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a Python file: what a reader takes for documentation (the
    code itself is checked by running it)."""
    text = path.read_text(encoding="utf-8")
    prose = [(node.body[0].lineno, ast.get_docstring(node, clean=False)) for node in ast.walk(ast.parse(text))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
             and ast.get_docstring(node, clean=False)]
    prose += [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(text).readline)
              if token.type == tokenize.COMMENT]
    return prose


def _cited_prose() -> list[tuple[str, str]]:
    """(where, text): the docstrings and comments of the repository's Python files, and its documents (README.md,
    ARCHITECTURE.md, benchmarks/README.md, docs/*.md)."""
    prose = [(f"{path.relative_to(ROOT)}:{line}", text) for d in REPO_DIRS for path in sorted((ROOT / d).rglob("*.py"))
             for line, text in _python_prose(path)]
    documents = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "benchmarks" / "README.md",
                 *sorted((ROOT / "docs").glob("*.md"))]
    return prose + [(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")) for path in documents]


def _repo_files() -> set[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if (ROOT / line).is_file()}


def _path_exists(path: str, files: set[str]) -> bool:
    """A cited path exists: from the checkout's root, from the package (`integrations/...`, or the installed
    names `zenflow_compile/runtime/...`), or as the tail of a file's path; a bare file name anywhere."""
    path = re.sub(r"^zenflow_compile/(passes|runtime|triton_kernels)/", r"\1/", path)
    if "/" not in path:
        return any(f == path or f.endswith("/" + path) for f in files)
    return path in files or f"zenflow_compile/{path}" in files or any(f.endswith("/" + path) for f in files)


def _class_files(name: str, classes: dict) -> list[Path]:
    """The files that define class `name` and its bases defined here: a base's members are the class's
    (`ZenFlowAdamW.load_state_dict`, defined by its base `CheckpointMixin`)."""
    files = list(classes[name])
    for path in classes[name]:
        header = re.search(rf"^class {name}\(([^)]*)\)", path.read_text(encoding="utf-8"), flags=re.M)
        for base in re.findall(r"\w+", header.group(1)) if header else []:
            if base in classes and base != name:
                files += _class_files(base, classes)
    return files


def _resolves(token: str, classes: dict, modules: dict) -> Optional[bool]:
    """Whether a backticked `token` names something the repository defines; None when it is not the
    project's to define (torch, a user's variable, another library)."""
    if re.fullmatch(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+", token):  # a constant, or an environment variable
        if token.startswith(EXTERNAL_CAPS_PREFIXES):
            return None
        return any(_definitions(p, token) or f'"{token}"' in p.read_text(encoding="utf-8")
                   for d in REPO_DIRS for p in (ROOT / d).rglob("*.py"))
    if not re.fullmatch(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", token):
        return None
    if re.search(r"\.(py|md|json|toml|tab|txt|png|csv|ya?ml)$", token):
        return None  # a file name
    head, *rest = token.split(".")
    if head == "zenflow_compile":  # the import path: resolved by importing it
        parts = token.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    if head in classes:  # `Slab.export_member`, `Placement.adopt_casts`
        return any(_definitions(p, rest[0]) for p in _class_files(head, classes))
    if head in modules and head not in AMBIGUOUS_MODULES:  # `kernels.cpu_adamw_`, `layout.SHARED_SLAB_MAX_NUMEL`
        return any(_definitions(p, rest[0]) for p in modules[head])
    return None


def test_what_docstrings_comments_and_docs_cite_exists():
    """Every file path the docstrings and comments of the repository's Python files and its documents cite
    (`runtime/state/slab.py`, `tests/helpers.py`, `grad_hooks.py`) exists in the checkout, and every backticked
    name that looks like the project's (`Slab.export_member`: a member of a class defined here; `kernels.cpu_adamw_`:
    a name in a package module; `zenflow_compile.ZenFlowAdamW`: an import path; a constant or environment
    variable in capitals) is defined in its source: a rename or a removal must take its citations with it. A
    FILE::NAME citation names a definition in that file."""
    files = _repo_files()
    sources = [p for d in REPO_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    classes: dict[str, list[Path]] = {}
    for path in sources:
        for name in re.findall(r"^class (\w+)", path.read_text(encoding="utf-8"), flags=re.M):
            classes.setdefault(name, []).append(path)
    modules: dict[str, list[Path]] = {}
    for path in (p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py") if p.stem != "__init__"):
        modules.setdefault(path.stem, []).append(path)
    checked, stale = 0, []
    for where, text in _cited_prose():
        for path in CITED_PATH.findall(text):
            root = path.split("/")[0]
            if ("/" in path and root not in PATH_ROOTS) or ("/" not in path and not path.endswith(".py")):
                continue  # another project's file, or an output a command writes (`zenflow_check.md`)
            checked += 1
            if not _path_exists(path, files):
                stale.append(f"{where}: {path}")
        for token in BACKTICKED.findall(text):
            token = token.removesuffix("()")
            if "::" in token and token.split("::")[0].endswith(".py"):
                path, name = token.split("::", 1)
                if path.split("/")[0] not in PATH_ROOTS:
                    continue  # another project's function (`deepspeed/runtime/zenflow/zenflow_utils.py::...`)
                checked += 1
                if not (_path_exists(path, files) and (ROOT / path).is_file()
                        and _definitions(ROOT / path, name.split(".")[-1])):
                    stale.append(f"{where}: {token}")
                continue
            verdict = _resolves(token, classes, modules)
            checked += verdict is not None
            if verdict is False:
                stale.append(f"{where}: {token}")
    assert checked > 300, checked  # (the scanner still finds the citations)
    assert not stale, "cited but not in the repository:\n" + "\n".join(sorted(set(stale)))


# ------------------------------------------------------------------------------------- errors that help
def test_misspelt_config_keys_suggest_the_right_one():
    with pytest.raises(TypeError, match=r"'topk_ration': did you mean 'topk_ratio'\?"):
        ZenFlowConfig(topk_ration=0.1)
    with pytest.raises(ValueError, match=r"'update_intervall': did you mean 'update_interval'\?"):
        ZenFlowConfig.from_dict({"update_intervall": 4})
    with pytest.raises(ValueError, match=r"'overlap': did you mean 'overlap_step'\?"):
        ZenFlowConfig.from_dict({"overlap": True})
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"'weight_decy': did you mean 'weight_decay' \(an argument of ZenFlowAdamW"):
        ZenFlowAdamW(model.parameters(), lr=1e-3, weight_decy=0.1)
    with pytest.raises(ValueError, match=r"'amsgrad' is a torch\.optim\.AdamW argument: ZenFlowAdamW implements "
                                         r"AdamW without amsgrad"):
        ZenFlowAdamW(model.parameters(), lr=1e-3, amsgrad=True)
    with pytest.raises(ValueError, match=r"'lr' is an argument of ZenFlowAdamW\(\.\.\.\), not a ZenFlow config key"):
        ZenFlowConfig.from_dict({"lr": 1e-3})
    # still valid keys only, nothing else changed
    assert ZenFlowConfig(topk_ratio=0.2).topk_ratio == 0.2


@pytest.mark.parametrize("options,message", [
    ({"topk_ration": 0.1}, r"unknown option 'topk_ration' for backend='zenflow' \('topk_ration': did you mean "
                           r"'topk_ratio'\?\)"),
    ({"max_grad_norm": 1.0}, r"'max_grad_norm' is an argument of ZenFlowAdamW\(\.\.\.\), not a ZenFlow config key"),
    ({"max_autotun": True}, r"'max_autotun': did you mean 'max_autotune'\?"),
])
def test_misspelt_backend_options_suggest_the_right_one(options, message):
    torch._dynamo.reset()
    model = nn.Linear(4, 4)
    ZenFlowAdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="zenflow", options=options)
    with pytest.raises(Exception, match=message):
        compiled(torch.randn(2, 4))


class _Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        return self.fc(x).square().mean()


def _train_once(model, **compile_kwargs):
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.5, update_interval=2)
    torch.compile(model, backend="zenflow", **compile_kwargs)(torch.randn(3, 12)).backward()
    opt.step()
    return opt


def test_debug_dir_takes_the_dash_spelling(tmp_path):
    torch._dynamo.reset()
    _train_once(_Probe(), options={"debug-dir": str(tmp_path)})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.endswith("_before.py") for n in names) and any(n.endswith("_after.py") for n in names), names
    assert "torch.ops.zenflow.accumulate_grads" in next(tmp_path.glob("*_after.py")).read_text()


def test_a_graph_from_the_cache_says_why_its_rewrite_is_not_logged(caplog):
    """A warm AOTAutograd cache serves the backward already rewritten: TORCH_LOGS / TORCH_TRACE stay silent,
    and the zenflow_compile log says so and how to see the rewrite."""
    torch._dynamo.reset()
    _train_once(_Probe())  # compiles (or hits a cache an earlier run filled): the cache now holds the graph
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="zenflow_compile.backend"):
        opt = _train_once(_Probe())
    notes = [r.getMessage() for r in caplog.records if "loaded from AOTAutograd's cache" in r.getMessage()]
    assert notes, [r.getMessage() for r in caplog.records]
    assert "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1" in notes[0] and "debug_dir" in notes[0]
    assert opt.stats()["steps"] == 1  # and the cached graph still hands its gradients over


def _clip_and_step(model, run, opt, steps: int = 3) -> list[float]:
    norms = []
    for _ in range(steps):
        run(torch.randn(3, 12)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)))
        opt.step()
        opt.zero_grad()
    return norms


def test_clip_grad_norm_beside_a_compiled_model_is_told_once_to_use_max_grad_norm():
    """Compiled, the gradients never reach `.grad`: `clip_grad_norm_` returns 0 and clips nothing, and leaves no
    trace. The first step whose gradients came through the graph warns (once per optimizer, pointing at the
    caller's `opt.step()`) that clipping goes through `max_grad_norm`; an optimizer with `max_grad_norm` is not
    warned, nor is an eager one, whose `.grad` `clip_grad_norm_` does clip."""
    torch._dynamo.reset()
    model = _Probe()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.5, update_interval=2)
    with pytest.warns(zenflow_compile.GradHandOffWarning) as warned:
        norms = _clip_and_step(model, torch.compile(model, backend="zenflow"), opt)
    assert norms == [0.0, 0.0, 0.0]  # the trap itself
    told = [w for w in warned if issubclass(w.category, zenflow_compile.GradHandOffWarning)]
    assert len(told) == 1 and told[0].filename == __file__, [(w.filename, str(w.message)) for w in told]
    message = str(told[0].message)
    assert "clip_grad_norm_" in message and "clips nothing" in message and "max_grad_norm=" in message
    assert "opt.stats()['grad_norm']" in message

    for compiled, max_grad_norm in ((True, 1.0), (False, None)):
        model = _Probe()
        opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.5, update_interval=2,
                           max_grad_norm=max_grad_norm)
        with warnings.catch_warnings():
            warnings.simplefilter("error", zenflow_compile.GradHandOffWarning)
            norms = _clip_and_step(model, torch.compile(model, backend="zenflow") if compiled else model, opt)
        assert all(norm > 0 for norm in norms) != compiled
