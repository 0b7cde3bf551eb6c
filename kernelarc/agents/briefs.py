"""Strategy briefs: the user-editable text that tells an LLM agent how to work its strategy.

The shipped briefs are Markdown files named ``<strategy>.md`` in ``conf/strategies/briefs/``.
``load_brief(strategy)`` reads the shipped one; ``override_path`` replaces it with a file of the
user's (a ``.md`` file, or a folder holding ``<strategy>.md``).
"""

from __future__ import annotations

from pathlib import Path

from kernelarc.families.base import STRATEGIES

_HERE = Path(__file__).resolve()
# Searched in order: inside the package (if the briefs are shipped as package data), then the
# repository's conf/ folder (source checkout / editable install).
BRIEF_DIRS = (
    _HERE.parents[1] / "conf" / "strategies" / "briefs",
    _HERE.parents[2] / "conf" / "strategies" / "briefs",
)


def brief_path(strategy: str) -> Path:
    """The shipped brief file of ``strategy``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")
    for d in BRIEF_DIRS:
        p = d / f"{strategy}.md"
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"no brief for strategy {strategy!r}: looked for {strategy}.md in " + ", ".join(str(d) for d in BRIEF_DIRS)
    )


def load_brief(strategy: str, override_path: str | Path | None = None) -> str:
    """The brief text for ``strategy``.

    ``override_path``: a file whose text replaces the shipped brief, or a folder in which
    ``<strategy>.md`` is looked up (missing there: the shipped brief is used). Raises
    ``ValueError`` for an unknown strategy or an empty brief, ``FileNotFoundError`` for an
    override path that does not exist.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")
    path: Path | None = None
    if override_path is not None and str(override_path) != "":
        p = Path(override_path).expanduser()
        if p.is_dir():
            cand = p / f"{strategy}.md"
            path = cand if cand.is_file() else None
        elif p.is_file():
            path = p
        else:
            raise FileNotFoundError(f"brief override {p} does not exist (give a .md file or a folder of <strategy>.md)")
    if path is None:
        path = brief_path(strategy)
    text = path.read_text(encoding="utf-8").strip()
    if not text:
        raise ValueError(f"brief {path} is empty")
    return text + "\n"
