"""The registry as a kernel library: the champion registered for a built-in task on this GPU (here the
built-in fused_add_rmsnorm) starts a composed problem's site of that kernel family, right after the
family's own start point, and a session prints where it came from."""

from __future__ import annotations

from _problems import ADD_RMS_MLP, make_task

from kernelarc.families import families_for
from kernelarc.families.composed import library_tasks, start_points
from kernelarc.models import Candidate, Status, Verdict
from kernelarc.registry import Registry, kernel_library
from kernelarc.tracking import Tracker

PREFIX = "composed.p_lib."


def _task(tmp_path):
    return make_task(tmp_path, "p_lib", ADD_RMS_MLP,
                     {"x": (["T", "H"], "bfloat16"), "res": (["T", "H"], "bfloat16"), "w": (["H"], "bfloat16"),
                      "wg": (["F", "H"], "bfloat16"), "wu": (["F", "H"], "bfloat16")},
                     {"h": (["T", "F"], "bfloat16"), "s": (["T", "H"], "bfloat16")},
                     [{"T": 4, "H": 64, "F": 32}])  # fmt: skip


def _register(uri: str, task: str, family: str, knobs: dict) -> None:
    tr = Tracker(uri, task, "h200")
    tr.start_session({"task": task})
    cand = Candidate(source=f"# {family} {knobs}\ndef run(x):\n    return x\n", language="triton", agent="a0",
                     strategy="tiling", family=family, knobs=knobs)  # fmt: skip
    v = Verdict(candidate_id=cand.id, status=Status.champion, latency_ms=0.1)
    reg = Registry(tr, task, "h200")
    reg.promote(reg.register(cand, v, tr.log_candidate(cand, v)), True)
    tr.end_session()


def test_a_registered_champion_starts_the_site_of_its_family(tmp_path):
    task = _task(tmp_path / "p")
    fams = families_for(task)
    wanted = library_tasks(task, fams)
    assert "fused_add_rmsnorm" in wanted and "fused_add_rmsnorm.rowblock" in wanted["fused_add_rmsnorm"]
    base = next(f for f in fams if f.name == PREFIX + "fused_add_rmsnorm.rowblock")
    k = next(k for k in base.knobs if k.name == "num_warps")
    tuned_warps = next(v for v in k.values if v != base.start["num_warps"])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    _register(uri, "fused_add_rmsnorm", "fused_add_rmsnorm.rowblock", {"num_warps": tuned_warps, "bogus": 1})
    _register(uri, "swiglu", "reference", {"mode": "eager"})  # a baseline champion: nothing to start from

    lib = kernel_library(uri, "h200", wanted)
    assert set(lib) == {"fused_add_rmsnorm.rowblock"}
    knobs, where = lib["fused_add_rmsnorm.rowblock"]
    assert where == "kernelarc.fused_add_rmsnorm.h200 v1"

    plain = start_points(task, fams)
    seeds = start_points(task, fams, {f: kn for f, (kn, _) in lib.items()})
    assert len(seeds) == len(plain) + 1
    at = next(i for i, (f, _) in enumerate(seeds) if f.name == base.name)
    assert seeds[at] == plain[at]  # the family's own start first
    fam, point = seeds[at + 1]
    assert fam.name == base.name and point["num_warps"] == tuned_warps and "bogus" not in point
    assert {k: v for k, v in point.items() if k != "num_warps"} == {
        k: v for k, v in seeds[at][1].items() if k != "num_warps"
    }
    assert fam.valid(point)


def test_no_store_or_no_champion_is_an_empty_library(tmp_path):
    wanted = {"rmsnorm": {"rmsnorm.rowblock"}}
    assert kernel_library(f"sqlite:///{tmp_path}/empty.db", "h200", wanted) == {}
    bad = tmp_path / "not_a_db.db"
    bad.write_bytes(b"this is not an SQLite database" * 100)
    assert kernel_library(f"sqlite:///{bad}", "h200", wanted) == {}  # a warning, not an exception
    assert bad.read_bytes() == b"this is not an SQLite database" * 100  # and the file is left as it was


def test_the_wiring_hands_the_library_to_the_team_and_says_so(tmp_path):
    from types import SimpleNamespace

    from kernelarc.ablate import _compose
    from kernelarc.app import build_agents, typed
    from kernelarc.wiring import kernel_library as wired

    task = _task(tmp_path / "p")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    _register(uri, "fused_add_rmsnorm", "fused_add_rmsnorm.rowblock", {"num_warps": 1})
    cfg = typed(_compose(["+task=sol_execbench", f"task.path={tmp_path / 'p'}", f"tracking.uri={uri}"]))

    class Lines:
        said: list[str] = []

        def line(self, text: str) -> None:
            self.said.append(text)

    ui = Lines()
    lib = wired(cfg, task, SimpleNamespace(name="h200"), ui)
    assert lib == {"fused_add_rmsnorm.rowblock": {"num_warps": 1}}
    assert ui.said == [
        "kernel library: fused_add_rmsnorm.rowblock starts from kernelarc.fused_add_rmsnorm.h200 v1@champion"
    ]
    agents = build_agents(cfg, task, lib)
    seeds = [p for a in agents for f, p in a._seeds if f.name == PREFIX + "fused_add_rmsnorm.rowblock"]
    assert any(p["num_warps"] == 1 for p in seeds)


def test_the_library_can_be_another_store_than_the_tracking_one(tmp_path):
    # suite shards track into their own stores; the built-in tasks' champions live in one library store
    from types import SimpleNamespace

    from kernelarc.ablate import _compose
    from kernelarc.app import typed
    from kernelarc.wiring import kernel_library as wired

    task = _task(tmp_path / "p")
    lib_uri = f"sqlite:///{tmp_path}/library.db"
    _register(lib_uri, "fused_add_rmsnorm", "fused_add_rmsnorm.rowblock", {"num_warps": 1})
    over = ["+task=sol_execbench", f"task.path={tmp_path / 'p'}", f"tracking.uri=sqlite:///{tmp_path}/shard.db"]
    ui = SimpleNamespace(line=lambda text: None)
    assert wired(typed(_compose(over)), task, SimpleNamespace(name="h200"), ui) is None
    cfg = typed(_compose([*over, f"search.library_uri={lib_uri}", "tracking.enabled=false"]))
    assert wired(cfg, task, SimpleNamespace(name="h200"), ui) == {"fused_add_rmsnorm.rowblock": {"num_warps": 1}}
