"""The package layout docs/design.md draws is the package's, and its imports flow down the data path.

The tree under "The package" lists every module of src/fastt in the order of the data path; a module may
import only modules listed above it (a package drawn as one line, `zoo/`, is one entry: its modules import
each other freely). Imports inside functions count; those under `if TYPE_CHECKING:` (annotations only) do not.
The one exception is the one "Modules and imports" names: OS-DPOS judges its candidates by the simulator.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
KNOWN_EXCEPTIONS = {("fastt.plan.osdpos", "fastt.simulate"), ("fastt.cluster", "fastt.cluster_file")}


def tree_order() -> list[str]:
    """The design's tree as module names in order: `fastt.plan.dpos`, `fastt.plan` for plan/__init__.py, and
    `fastt.zoo` for a package drawn as one line."""
    text = (ROOT / "docs/design.md").read_text()
    block = text[text.index("```\nsrc/fastt/\n") + len("```\nsrc/fastt/\n"):]
    block = block[:block.index("```")]
    order, stack = [], []
    lines = block.splitlines()
    for k, line in enumerate(lines):
        depth = (len(line) - len(line.lstrip())) // 2 - 1
        name = line.split()[0]
        stack = stack[:depth]
        if name.endswith("/"):
            stack.append(name[:-1])
            following = lines[k + 1] if k + 1 < len(lines) else ""
            if (len(following) - len(following.lstrip())) // 2 - 1 <= depth:  # drawn as one line
                order.append(".".join(["fastt", *stack]))
                stack.pop()
            continue
        assert re.fullmatch(r"\w+\.py", name), line
        module = name[:-3]
        order.append(".".join(["fastt", *stack] + ([] if module == "__init__" else [module])))
    return order


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "fastt").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """The fastt modules `name` imports, with the line, leaving out `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for body in node.body for n in ast.walk(body)}
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        out += [(t, node.lineno) for t in targets if t == "fastt" or t.startswith("fastt.")]
    return out


def entry(module: str, order: list[str]) -> int:
    """The position of `module`'s line in the tree: its own, or that of the package drawn as one line."""
    if module in order:
        return order.index(module)
    whole = [k for k, m in enumerate(order) if module.startswith(m + ".")
             and (SRC / m.replace(".", "/")).is_dir() and not any(o.startswith(m + ".") for o in order)]
    assert whole, f"{module} is not in docs/design.md's package tree: add a line for it"
    return whole[0]


def test_the_tree_lists_every_module_once() -> None:
    order = tree_order()
    assert len(order) == len(set(order)), [m for m in order if order.count(m) > 1]
    drawn = {order[entry(m, order)] for m in modules()}
    assert drawn == set(order), f"drawn but not in src/: {sorted(set(order) - drawn)}"


def test_imports_flow_down_the_tree() -> None:
    order, known = tree_order(), set(modules())
    upward = set()
    for name, path in modules().items():
        for target, line in imports(name, path, known):
            if entry(target, order) > entry(name, order):
                upward.add((name, target))
                print(f"{path.relative_to(ROOT)}:{line} imports {target}, which the tree puts below it")
    assert upward == KNOWN_EXCEPTIONS
