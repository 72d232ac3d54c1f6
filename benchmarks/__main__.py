"""``python -m benchmarks [--quick ...]`` runs the benchmark; ``... table [...]`` renders one."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch to :func:`benchmarks.readme_table.main` or :func:`benchmarks.run.main`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"]:
        from benchmarks import readme_table

        return readme_table.main(argv[1:])
    from benchmarks import run

    return run.main(argv)


if __name__ == "__main__":
    sys.exit(main())
