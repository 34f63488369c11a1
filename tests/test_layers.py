"""Layers never import upward, and no module imports itself back through others (BUILD.md, "How the house is
organised").

Every `import` / `from ... import` of every module under mtrain/ (kernels/ and converters/ through their links),
at module level and inside functions alike, parsed with `ast` (nothing is imported). An import of a unit in a higher
layer fails naming the file and line; so does any cycle among modules. An import under `if TYPE_CHECKING:` must
follow the layers too (a type that lives upstairs is a sign the piece belongs lower) and counts in cycles: two
modules that name each other's types are one piece split in two.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "mtrain"

# Bottom to top. A unit is a subpackage or top-level module of mtrain; it may import its own layer and those below.
LAYERS: list[set[str]] = [
    {"compat", "fileperm", "debug_signals", "dist", "metrics", "wandb_log", "plot", "run_output", "tiny_configs", "tiny_vlm",
     "tiny_hf", "tokenizer_files", "paths", "run_files"},                                    # plain utilities: no knowledge of models or training
    {"config", "config_sections", "config_data", "config_checks", "config_error", "engine_args", "job_split"},  # the dataclass tree; every layer may read it
    {"kernels"},                                    # Triton/torch kernels on plain tensors
    {"layouts"},                                    # per-architecture weight-layout tables
    {"reshard"},                                    # the planner and executor of a weight sync
    {"models", "lora_checks"},                      # Megatron model building, forward, HF config facts; LoRA model checks
    {"data", "algorithms", "tools", "converters"},  # prompts and rewards, losses, agent tools, checkpoint formats
    {"rollout"},                                    # engines, the pool, trajectories, agents
    {"serve"},                                      # the OpenAI front
    {"trainer", "memory_plan"},                     # the RL loop; each GPU's memory planned from the config
    {"__main__", "preflight", "preflight_models", "preflight_resume", "serve_command", "gap_probe", "hub_models", "launch"},     # commands: parse, check, start
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def modules() -> dict[str, Path]:
    out = {}
    for d, _, names in os.walk(PKG, followlinks=True):
        for n in names:
            if n.endswith(".py"):
                f = Path(d) / n
                parts = list(f.relative_to(REPO).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = f
    return out


def type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The statements inside `if TYPE_CHECKING:` blocks."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                out.update(ast.walk(stmt))
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported mtrain module, line, runs) for every import statement in the file, wherever it stands; runs is False
    for an import under `if TYPE_CHECKING:`."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    tree = ast.parse(path.read_text(), str(path))
    annotation_only = type_checking_only(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        if isinstance(node, ast.ImportFrom):
            targets = targets[:-1] or targets  # each imported name (a module, or an attribute of `base`)
        seen = set()
        for t in targets:
            if not (t == "mtrain" or t.startswith("mtrain.")):
                continue
            while t not in known and "." in t:  # `from mtrain.x import name`: name is an attribute, x the module
                t = t.rsplit(".", 1)[0]
            if t != name and t in known and t not in seen:
                seen.add(t)
                found.append((t, node.lineno, node not in annotation_only))
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int, bool]]]]:
    known = modules()
    return known, {m: imports(m, p, known) for m, p in known.items()}


def test_every_unit_has_a_layer():
    known, _ = graph()
    missing = sorted({unit(m) for m in known} - set(RANK) - {"__init__"})
    assert not missing, f"units without a layer in tests/test_layers.py LAYERS: {missing}"


def test_no_upward_import():
    known, edges = graph()
    bad = []
    for m, targets in sorted(edges.items()):
        for t, line, _ in targets:
            if unit(t) == "__init__" or unit(m) == "__init__":
                continue  # mtrain/__init__.py holds no code that layers share
            if RANK[unit(t)] > RANK[unit(m)]:
                bad.append(f"{known[m].relative_to(REPO)}:{line}: {m} ({unit(m)}, layer {RANK[unit(m)]}) imports "
                           f"{t} ({unit(t)}, layer {RANK[unit(t)]})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycle():
    known, all_edges = graph()
    edges = {m: [(t, line) for t, line, _ in targets] for m, targets in all_edges.items()}
    # Tarjan's strongly connected components over modules; a component of two or more modules is a cycle.
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    lines = []
    for comp in comps:
        inside = set(comp)
        lines.append("cycle: " + ", ".join(comp))
        lines += [f"  {known[m].relative_to(REPO)}:{line}: {m} imports {t}"
                  for m in comp for t, line in edges[m] if t in inside]
    assert not comps, "import cycles:\n" + "\n".join(lines)
