"""Print what kernelarc.graph recognises in every SOL-ExecBench problem folder, and which families
``families_for`` offers for it.

    python3 scripts/recognize_report.py [ROOT]   (default ../shared/sol-execbench)

Columns: problem, graph cases (symbolic / concrete), recognised sites (kind x count; elementwise
chains and reductions counted separately), substitutable sites (library / family), families offered.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernelarc.families import families_for  # noqa: E402
from kernelarc.families.composed import recognise  # noqa: E402
from kernelarc.graph.adapters import Impl  # noqa: E402
from kernelarc.graph.patterns import Kind  # noqa: E402
from kernelarc.tasks.loader import TaskError, load_task  # noqa: E402


def report(root: Path) -> int:
    folders = sorted(p.parent for p in root.glob("*/*/definition.json"))
    print(f"{'problem':58} {'cases':9} {'recognised':48} {'subst (lib/fam)':16} families offered")
    n_rec = n_fam = n_cap = 0
    kinds_fam: Counter[str] = Counter()
    for folder in folders:
        t0 = time.time()
        name = f"{folder.parent.name}/{folder.name}"
        try:
            task = load_task(folder)
        except TaskError as e:
            print(f"{name:58} load error: {e}")
            continue
        rec = recognise(task)
        if rec.capture is None:
            print(f"{name:58} {'-':9} not captured: {rec.error[:90]}")
            continue
        cases = rec.capture.cases
        n_cap += 1
        sym = sum(c.symbolic for c in cases)
        counts: Counter[str] = Counter()
        lib = fam = 0
        for case_sites in rec.sites[:1]:  # the first case (cases differ by scalar values or shapes only)
            for s in case_sites:
                counts[s.kind.value] += 1
                impls = rec.impls.get(id(s), set())
                lib += Impl.library in impls
                fam += Impl.family in impls
        main = [f"{k}x{v}" if v > 1 else k for k, v in counts.items() if k not in (Kind.elementwise, Kind.reduction)]
        side = [f"{k[:4]}x{counts[k]}" for k in (Kind.elementwise.value, Kind.reduction.value) if counts[k]]
        fams = [f.name.removeprefix(f"composed.{task.name}.") for f in families_for(task)]
        n_rec += bool(main)
        n_fam += any(f != "library" for f in fams)
        kinds_fam.update({s.kind.value for c in rec.sites for s in c if Impl.family in rec.impls.get(id(s), set())})
        shown = ", ".join(fams) if fams else "(generic only)"
        print(f"{name:58} {f'{sym}s/{len(cases) - sym}c':9} {' '.join(main + side)[:48]:48} {f'{lib}/{fam}':16} "
              f"{shown}  [{time.time() - t0:.1f}s]")  # fmt: skip
    print(f"\n{len(folders)} problems; {n_cap} captured; {n_rec} with a recognised pattern; "
          f"{n_fam} offered a KernelArc kernel family")  # fmt: skip
    print("problems with a family-substitutable site, per kind: " + ", ".join(f"{k} {v}" for k, v in kinds_fam.items()))
    return 0


def _default_root() -> Path:
    # ../shared from the main checkout, ../../shared from a worktree under wt/
    for up in (ROOT.parent, ROOT.parent.parent):
        if (up / "shared" / "sol-execbench").is_dir():
            return up / "shared" / "sol-execbench"
    return ROOT.parent / "shared" / "sol-execbench"


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else _default_root()
    if not any(root.glob("*/*/definition.json")):
        sys.exit(f"no problem folders (*/*/definition.json) under {root}")
    logging.disable(logging.WARNING)
    sys.exit(report(root))
