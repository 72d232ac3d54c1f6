"""Counting jaxmem's compiles in a test (every candidate, the plain step, the checked plan)."""

from __future__ import annotations

from jaxmem import measure


def count_compiles(monkeypatch) -> list[int]:
    """A list that grows by one at each ``jaxmem.measure.compile`` call from now on."""
    calls: list[int] = []
    real = measure.compile

    def counting(lowered, options=None):
        calls.append(1)
        return real(lowered, options)

    monkeypatch.setattr(measure, "compile", counting)
    return calls


def compile_once():
    """A context in which ``jaxmem.measure.compile`` compiles each distinct lowered program
    once and hands the same executable back for it again (modules that set
    ``COMPILE_ONCE = True``, conftest.py). XLA's compile is deterministic; a program is
    keyed by its whole text, the compiler options and where it is compiled for (the
    backend, the argument and result shardings, with their devices), so a CUDA and a TPU
    lowering of the same text stay apart. Not for modules that check that an executable is
    reused (``is``) or count XLA's compiles rather than jaxmem's calls."""
    import contextlib
    import hashlib

    import pytest

    real, memo = measure.compile, {}

    def key(lowered, options):
        args = getattr(getattr(lowered, "_lowering", None), "compile_args", {})
        where = repr((getattr(args.get("backend"), "platform", None),
                      args.get("in_shardings"), args.get("out_shardings")))
        return (hashlib.sha256(lowered.as_text().encode()).hexdigest(), where,
                repr(sorted((options or {}).items())))

    def compiled_once(lowered, options=None):
        k = key(lowered, options)
        if k not in memo:
            memo[k] = real(lowered, options)
        return memo[k]

    @contextlib.contextmanager
    def patched():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(measure, "compile", compiled_once)
            yield
    return patched()


def one_rewrite_plan(monkeypatch) -> None:
    """``verify`` compiles one of the rewrite's candidate plans (the automatic mode's first)
    beside the plain step, not its best-predicted three: for a test about something every
    rewritten plan must do (its values, its donation, the plan cache), not about which plan
    compiles lowest. A test using it should still run a rewritten plan (no "kept the plain
    step" warning)."""
    from jaxmem.planning import strategies

    candidates = strategies.auto_candidates
    monkeypatch.setattr(strategies, "auto_candidates",
                        lambda a, **kw: candidates(a, **kw)[:1])


def one_builtin(monkeypatch, per_block: bool) -> None:
    """``verify="builtins"`` compiles one of the two built-in candidates: the policy around
    each block (``per_block``) or around the whole loss, for a test whose relation is that
    one's."""
    from jaxmem.compiling import choose

    builtins = choose.builtin_candidates

    def only(*a, **kw):
        found, skipped = builtins(*a, **kw)
        return [c for c in found if c.plan.loss_blocks == per_block], skipped

    monkeypatch.setattr(choose, "builtin_candidates", only)
