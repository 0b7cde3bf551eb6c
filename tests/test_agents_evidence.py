"""What offline agents conclude from measured points: equivalences that other findings can refute,
failures weighed against successes, and the leaderboard of the siblings' bests read at memory 0."""

from kernelarc.agents.base import AgentContext
from kernelarc.agents.search import SearchAgent, _Info
from kernelarc.board import Conditions, Entry, Kind
from kernelarc.families import families_for
from kernelarc.models import Status
from kernelarc.tasks import load_builtin


def _point(fam, **kw):
    return {**fam.start, **kw}


def _info(fam, rows):
    known = [(lat, fam, knobs, f"c{i}", "") for i, (knobs, lat) in enumerate(rows)]
    info = _Info({}, {}, sorted(known, key=lambda k: k[0]), [], {})
    info.pair_evidence()
    return info


def test_a_value_pair_that_timed_apart_anywhere_is_not_equivalent():
    fam = families_for("matmul")[0]
    # BLOCK_N 64 vs 128 timed alike at 2 warps, apart at 8 warps (the knobs are coupled)
    flat = [(_point(fam, num_warps=2, BLOCK_N=64), 1.0), (_point(fam, num_warps=2, BLOCK_N=128), 1.005)]
    steep = [(_point(fam, num_warps=8, BLOCK_N=64), 1.0), (_point(fam, num_warps=8, BLOCK_N=128), 0.7)]
    assert _info(fam, flat).equivalent(fam.name, "BLOCK_N", 64, 128)
    both = _info(fam, flat + steep)
    assert not both.equivalent(fam.name, "BLOCK_N", 64, 128)
    # so the wide tile at 16 warps is worth timing once the refuting pair is known, not before
    target = _point(fam, num_warps=16, BLOCK_N=128)
    near = [(_point(fam, num_warps=16, BLOCK_N=64), 0.9)]  # 16 warps time apart from 2 and 8
    assert _info(fam, flat + near).near_duplicate(fam.name, target)
    assert not _info(fam, flat + steep + near).near_duplicate(fam.name, target)


def _entry(fam, cid, knobs, status, latency, agent="a1-explore"):
    kind = Kind.trap if status is not Status.champion else Kind.win
    return Entry(agent=agent, strategy="explore", candidate_id=cid, family=fam.name, knobs=knobs, status=status,
                 gain=-0.3 if status.correct else None, lesson="m", kind=kind,
                 conditions=Conditions(latency_ms=latency))  # fmt: skip


def test_a_value_that_keeps_working_is_not_condemned_by_one_failure():
    task = load_builtin("matmul", cpu=True)
    fam = families_for(task)[0]
    agent = SearchAgent("agent0-exploit", "exploit", task, seed=0)
    bad = _entry(fam, "bad", _point(fam, BLOCK_N=128, num_stages=3), Status.incorrect, None)
    # its nearest correct point differs in BLOCK_N and num_stages: both are suspected
    near = _entry(fam, "near", _point(fam, BLOCK_N=64, num_stages=2), Status.correct_slower, 3.0)
    # correct points farther away that all had BLOCK_N=128
    ok = [_entry(fam, f"ok{g}", _point(fam, BLOCK_N=128, num_stages=2, GROUP_M=g, num_warps=8), Status.correct_slower,
                 2.0 + g) for g in (2, 4, 8)]  # fmt: skip
    few = agent._info(AgentContext(task, None, None, None, [bad, near], [], frozenset()))
    many = agent._info(AgentContext(task, None, None, None, [bad, near, *ok], [], frozenset()))
    n128, s3 = (fam.name, "BLOCK_N", "128"), (fam.name, "num_stages", "3")
    assert few.fails[n128] == few.fails[s3] > 0
    # more findings weigh the value's failure against its three successes; the untried value keeps its blame
    assert many.fails[n128] < 0.5 * few.fails[n128] and many.fails[s3] == few.fails[s3]


def test_at_memory_zero_an_agent_still_builds_on_the_siblings_bests():
    task = load_builtin("matmul", cpu=True)
    fam = families_for(task)[0]
    best = _entry(fam, "sib", _point(fam, BLOCK_M=128, BLOCK_N=128, num_warps=8), Status.correct_slower, 1.5)
    agent = SearchAgent("agent0-exploit", "exploit", task, seed=0)
    alone = agent._info(AgentContext(task, None, None, None, [], [], frozenset()))
    led = agent._info(AgentContext(task, None, None, None, [], [], frozenset(), leaders=[best]))
    assert alone.known == [] and led.known[0][3] == "sib"
    prop = agent.propose(AgentContext(task, None, None, None, [], [], frozenset(), leaders=[best]), 2)
    why = [c.rationale for c in prop.candidates]
    assert all(c.parent == "sib" for c in prop.candidates if c.family == fam.name), why
