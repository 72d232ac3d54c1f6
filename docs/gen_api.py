"""Generate docs/api.md from jaxmem's docstrings and signatures.

Run:  python docs/gen_api.py > docs/api.md

Nothing in the output is typed by hand: every signature comes from ``inspect.signature`` and
every description from the object's docstring, so the reference cannot drift from the code.
``--check`` exits 1 if docs/api.md differs from what would be generated (for CI).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jaxmem

#: (section title, module, names to document; None = the module's ``__all__`` or public names).
SECTIONS: list[tuple[str, str, list[str] | None]] = [
    ("Train steps", "jaxmem", ["optimize", "Optimized", "Plan", "Choice", "Decision"]),
    ("Analysis", "jaxmem", ["analyze", "Analysis", "Residual", "trace", "Program", "TraceError"]),
    ("Budgets and offload", "jaxmem",
     ["Budget", "BudgetError", "pareto", "offload_name", "DeviceProfile"]),
    ("Functions differentiated later", "jaxmem", ["checkpoint", "Checkpointed"]),
    ("jaxmem.policies", "jaxmem.policies", None),
    ("jaxmem.primitives", "jaxmem.primitives", ["Kind", "classify", "register"]),
    ("jaxmem.analyzing.chains", "jaxmem.analyzing.chains", None),
    ("jaxmem.tracing.structure", "jaxmem.tracing.structure", None),
    ("jaxmem.planning.strategies", "jaxmem.planning.strategies", None),
    ("jaxmem.planning.costs", "jaxmem.planning.costs", None),
    ("jaxmem.rewriting.blockwise", "jaxmem.rewriting.blockwise", None),
    ("jaxmem.planning.budget", "jaxmem.planning.budget",
     ["plan_with_budget", "Candidate", "greedy", "exact", "Pareto", "ParetoRow"]),
    ("jaxmem.rewriting.rewrite", "jaxmem.rewriting.rewrite", None),
    ("jaxmem.memory.state_offload", "jaxmem.memory.state_offload", None),
    ("jaxmem.memory.param_offload", "jaxmem.memory.param_offload", None),
    ("jaxmem.rewriting.scans", "jaxmem.rewriting.scans", None),
    ("jaxmem.compiling.scan_budget", "jaxmem.compiling.scan_budget", None),
    ("jaxmem.compiling.shard_map", "jaxmem.compiling.shard_map", None),
    ("Many processes (jaxmem.compiling.multihost)", "jaxmem.compiling.multihost", None),
    ("jaxmem.analyzing.losses", "jaxmem.analyzing.losses", None),
    ("Chunking", "jaxmem", ["chunked", "chunked_cross_entropy"]),
    ("jaxmem.flax.linen", "jaxmem.flax.linen", None),
    ("jaxmem.flax.nnx", "jaxmem.flax.nnx", None),
    ("jaxmem.measure", "jaxmem.measure", None),
    ("jaxmem.targets", "jaxmem.targets", None),
    ("jaxmem.rewriting.substitutes", "jaxmem.rewriting.substitutes",
     ["select_and_scatter_add", "substitute_for"]),
    ("jaxmem.managed_memory", "jaxmem.managed_memory", None),
    ("jaxmem.plan_cache", "jaxmem.plan_cache", ["set_dir", "directory", "clear_memory"]),
    ("Command line (python -m jaxmem)", "jaxmem.__main__", ["main", "load_target"]),
]


def _module(name: str) -> ModuleType:
    import importlib

    return importlib.import_module(name)


def _public(mod: ModuleType) -> list[str]:
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n, v in vars(mod).items() if not n.startswith("_")
                 and (inspect.isfunction(v) or inspect.isclass(v))
                 and getattr(v, "__module__", "").startswith("jaxmem")]
    return sorted(names, key=lambda n: (not n[0].islower(), n.lower()))


class _Default:
    """A default value printed by name, without the memory address of its repr."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        v = self.value
        if inspect.isfunction(v) or inspect.isclass(v):
            return f"{v.__module__}.{v.__qualname__}"
        text = repr(v)
        return "<default>" if " at 0x" in text else text


class _Ann(str):
    """An annotation string that prints without quotes (``from __future__ import annotations``)."""

    def __repr__(self) -> str:
        return str(self)


def _sig(obj: Any, name: str) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params = []
    for p in sig.parameters.values():
        if isinstance(p.annotation, str):
            p = p.replace(annotation=_Ann(p.annotation))
        if p.default is not inspect.Parameter.empty:
            p = p.replace(default=_Default(p.default))
        params.append(p)
    ret = sig.return_annotation
    sig = sig.replace(parameters=params,
                      return_annotation=_Ann(ret) if isinstance(ret, str) else ret)
    return f"{name}{sig}"


_SECTIONS = ("Args:", "Arguments:", "Returns:", "Raises:", "Attributes:", "Yields:")
_EXAMPLES = ("Example:", "Examples:")


def _doc(obj: Any) -> str:
    """A Google-style docstring as markdown: sections as bullet lists, examples fenced."""
    doc = inspect.getdoc(obj) or "*(no docstring)*"
    out: list[str] = []
    mode = "text"
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in _SECTIONS:
            out += ["", f"**{stripped[:-1]}**", ""]
            mode = "prose" if stripped in ("Returns:", "Yields:") else "section"
            continue
        if mode == "prose":
            if line.startswith(" ") and stripped:
                out.append(stripped)
                continue
            mode = "text"
        if stripped in _EXAMPLES:
            out += ["", f"**{stripped[:-1]}**", "", "```python"]
            mode = "example"
            continue
        if mode == "example":
            if stripped and not line.startswith(" "):
                out += ["```", ""]
                mode = "text"
            else:
                out.append(line[2:] if line.startswith("  ") else line)
                continue
        if mode == "section":
            if not stripped:
                continue
            if not line.startswith(" "):
                out.append("")
                mode = "text"
            elif line.startswith("    "):  # continuation of the item above
                out[-1] += " " + stripped
                continue
            else:
                head, sep, rest = stripped.partition(": ")
                if sep and len(head) < 60:
                    out.append(f"- `{head}`: {rest}")
                else:
                    out.append(f"- {stripped}")
                continue
        out.append(line)
    if mode == "example":
        while out and not out[-1].strip():
            out.pop()
        out.append("```")
    return "\n".join(out).strip()


def _members(cls: type) -> list[tuple[str, Any]]:
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_") and not (name == "__call__" and getattr(value, "__doc__", None)):
            continue
        if isinstance(value, property | staticmethod | classmethod) or inspect.isfunction(value):
            out.append((name, value))
    return out


def _render(name: str, obj: Any, qual: str) -> list[str]:
    lines: list[str] = []
    if inspect.isclass(obj):
        kind = "enum" if issubclass(obj, enum.Enum) else "class"
        lines += [f"### `{qual}`", "", f"*{kind}* `{_sig(obj, name)}`" if kind == "class"
                  else f"*{kind}*: " + ", ".join(f"`{m.name}`" for m in obj), "", _doc(obj), ""]
        if dataclasses.is_dataclass(obj):
            fields = [f.name for f in dataclasses.fields(obj) if not f.name.startswith("_")]
            if fields:
                lines += ["Fields: " + ", ".join(f"`{f}`" for f in fields), ""]
        for mname, member in _members(obj):
            if isinstance(member, property):
                head = f"- **`.{mname}`** (property)"
                doc = inspect.getdoc(member)
            else:
                fn = member.__func__ if isinstance(member, staticmethod | classmethod) else member
                head = f"- **`.{_sig(fn, mname).replace('(self, ', '(').replace('(self)', '()')}`**"
                doc = inspect.getdoc(fn)
            first = (doc or "").strip().split("\n\n")[0].replace("\n", " ")
            lines.append(f"{head}: {first}" if first else head)
        lines.append("")
    elif callable(obj):
        lines += [f"### `{qual}`", "", f"```python\n{_sig(obj, qual)}\n```", "", _doc(obj), ""]
    else:
        lines += [f"### `{qual}`", "", f"`{qual} = {obj!r}`"[:300], ""]
    return lines


def generate() -> str:
    """The whole of docs/api.md."""
    out = [
        "# API reference",
        "",
        "<!-- Generated by `python docs/gen_api.py > docs/api.md` from the docstrings and "
        "signatures. Do not edit by hand. -->",
        "",
        f"jaxmem {jaxmem.__version__}. " + (inspect.getdoc(jaxmem) or "").splitlines()[0],
        "",
        "Contents: " + " · ".join(
            f"[{title}](#{_anchor(title)})" for title, _, _ in SECTIONS),
        "",
    ]
    for title, modname, names in SECTIONS:
        mod = _module(modname)
        out += [f"## {title}", ""]
        if names is None:
            summary = (inspect.getdoc(mod) or "").split("\n\n")[0]
            if summary:
                out += [summary, ""]
        for n in names or _public(mod):
            obj = getattr(mod, n)
            qual = f"{modname}.{n}" if modname != "jaxmem.__main__" else f"jaxmem.__main__.{n}"
            out += _render(n, obj, qual)
    return "\n".join(out).rstrip() + "\n"


def _anchor(title: str) -> str:
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    """Print the reference (or, with ``--check``, compare it with docs/api.md)."""
    argv = sys.argv[1:] if argv is None else argv
    text = generate()
    if "--check" in argv:
        path = Path(__file__).with_name("api.md")
        if not path.exists() or path.read_text() != text:
            print(f"{path} is stale: run python docs/gen_api.py > docs/api.md", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
