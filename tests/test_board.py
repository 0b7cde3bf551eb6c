"""The board (wins and traps, bounded by memory.limit, persisted) and the plateau breaker."""

import json

from kernelarc.board import Board, Conditions, Kind
from kernelarc.models import Finding, Status
from kernelarc.plateau import Action, PlateauDetector


def _f(cid, status, gain, family="f.a", **knobs):
    return Finding(agent="a0", strategy="exploit", candidate_id=cid, family=family, knobs=knobs, status=status,
                   gain=gain, lesson=f"lesson {cid}")  # fmt: skip


def test_wins_rank_by_chained_speed_not_by_the_size_of_the_gain(tmp_path):
    b = Board(tmp_path / "board.jsonl")
    # w1 beats the reference by 3x; w2 beats w1 by 10%: w2 is the fastest kernel though its gain is smaller
    b.post(_f("w1", Status.champion, 2.0), conditions=Conditions(champion_id="ref"))
    b.post(_f("w2", Status.champion, 0.1), conditions=Conditions(champion_id="w1"))
    b.post(_f("slow", Status.correct_slower, -0.5), conditions=Conditions(champion_id="w2"))
    wins = b.wins(None)
    assert [w.candidate_id for w in wins] == ["w2", "w1"]
    assert abs(wins[0].speed - 3.3) < 1e-9 and abs(b.traps(None)[0].speed - 1.65) < 1e-9
    assert [w.candidate_id for w in b.wins(1)] == ["w2"]


def test_traps_are_newest_first_and_each_list_is_bounded(tmp_path):
    b = Board(tmp_path / "board.jsonl")
    for i in range(6):
        b.post(_f(f"t{i}", Status.compile_error if i % 2 else Status.correct_slower, None if i % 2 else -0.2))
    for i in range(3):
        b.post(_f(f"w{i}", Status.champion, 0.1 * (i + 1)))
    assert [t.candidate_id for t in b.traps(2)] == ["t5", "t4"]
    assert len(b.wins(2)) == 2 and len(b.view(2)) == 4 and b.view(0) == []
    assert len(b.view(None)) == 9
    assert all(e.kind is Kind.trap for e in b.traps(None)) and all(e.kind is Kind.win for e in b.wins(None))
    # two lessons about one candidate: it is shown once
    b.post(_f("t5", Status.compile_error, None))
    assert [t.candidate_id for t in b.traps(None)].count("t5") == 1


def test_findings_keep_conditions_and_reason_and_resume(tmp_path):
    path = tmp_path / "board.jsonl"
    b = Board(path)
    shapes = [{"M": 4096, "N": 4096, "K": 4096}]
    b.post(_f("w", Status.champion, 0.25, BLOCK_M=128), conditions=Conditions(workloads=shapes, champion_id="ref",
           latency_ms=0.8), reason="1.250x the champion")  # fmt: skip
    b.post(_f("t", Status.incorrect, None, BLOCK_M=256), reason="incorrect: max abs error 3.1 on workload 0")
    again = Board(path)
    assert len(again) == 2
    w, t = again.wins(None)[0], again.traps(None)[0]
    assert w.conditions.workloads == shapes and w.conditions.latency_ms == 0.8 and w.reason == "1.250x the champion"
    assert w.knobs == {"BLOCK_M": 128} and t.reason.startswith("incorrect") and t.kind is Kind.trap
    # a board written before wins and traps existed is classified from the status on load
    old = tmp_path / "old.jsonl"
    old.write_text(_f("c", Status.champion, 0.3).model_dump_json() + "\n" + "{torn\n")
    assert [e.kind for e in Board(old).all()] == [Kind.win]
    assert json.loads(path.read_text().splitlines()[0])["kind"] == "win"


def test_a_secret_never_reaches_the_reason(tmp_path, monkeypatch):
    key = "sk-ant-api03-" + "y" * 40
    monkeypatch.setenv("ANTHROPIC_API_KEY", key)
    b = Board(tmp_path / "board.jsonl")
    b.post(_f("t", Status.runtime_error, None), reason=f"runtime_error: server said {key}")
    assert key not in (tmp_path / "board.jsonl").read_text()


def test_only_benchmarked_non_improvements_advance_the_plateau():
    p = PlateauDetector(patience=3, families={"f.a": "triton"})
    for status in (Status.compile_error, Status.incorrect, Status.rejected_hack, Status.timeout) * 3:
        assert p.update(status, 0) is None
    assert p.since_gain == 0
    assert p.update(Status.correct_slower, 1) is None and p.update(Status.correct_slower, 2) is None
    assert p.update(Status.champion, 3) is None and p.since_gain == 0


def test_a_family_record_is_progress_for_the_plateau_while_the_library_leads():
    """Family records (the board's wins without a promotion) reset the counter; a record flag on a
    failed verdict means nothing; without records the breaker still fires after ``patience``."""
    p = PlateauDetector(patience=3, families={"f.a": "triton", "f.b": "triton"})
    for i in range(6):
        assert p.update(Status.correct_slower, i, record=i % 2 == 1) is None
    assert p.since_gain == 0 and p.fired == 0
    assert p.update(Status.compile_error, 6, record=True) is None and p.since_gain == 0
    events = [p.update(Status.correct_slower, 7 + i, tried={"f.a": 5}) for i in range(3)]
    assert events[:2] == [None, None] and events[2] is not None and events[2].target_family == "f.b"


def test_the_plateau_redirects_to_untried_structure_never_to_baseline_variants():
    fams = {"pytorch.compile_variants": "pytorch", "f.tri": "triton", "f.tri2": "triton", "f.cut": "cutlass"}
    p = PlateauDetector(patience=1, families=fams)
    ev = p.update(Status.correct_slower, 5, tried={"f.tri": 4}, champion_family="f.tri")
    assert ev.action is Action.switch_language and ev.target_family == "f.cut" and ev.from_family == "f.tri"
    ev = p.update(Status.correct_slower, 6, tried={"f.tri": 4, "f.cut": 1})
    assert ev.action is Action.explore_family and ev.target_family == "f.tri2"
    ev = p.update(Status.correct_slower, 7, tried={"f.tri": 4, "f.cut": 3, "f.tri2": 1}, champion_family="f.tri2")
    assert ev.action is Action.climb_family and ev.target_family == "f.cut"
    assert all(e.target_family != "pytorch.compile_variants" for e in p.events)
    assert "f.cut" in ev.instruction and ev.to_dict()["action"] == "climb_family"
    # a task without kernel families: the instruction asks for another algorithm, never compile settings
    q = PlateauDetector(patience=1, families={"pytorch.compile_variants": "pytorch"})
    ev = q.update(Status.correct_slower, 1)
    assert ev.action is Action.new_structure and ev.target_family is None and "algorithm" in ev.instruction


def test_a_family_record_is_a_win_while_the_library_leads(tmp_path):
    """Slower than the champion (the library) but faster than anything its family had: a win to build on."""
    b = Board(tmp_path / "board.jsonl")
    b.post(_f("a1", Status.correct_slower, -0.5, family="f.a"))  # first of f.a: its record
    b.post(_f("a2", Status.correct_slower, -0.6, family="f.a"))  # slower than a1: a trap
    b.post(_f("a3", Status.correct_slower, -0.2, family="f.a"))  # faster than a1: a record
    b.post(_f("a4", Status.correct_slower, -0.199, family="f.a"))  # inside the noise margin: a trap
    b.post(_f("b1", Status.incorrect, None, family="f.b"))  # never a record
    assert [w.candidate_id for w in b.wins(None)] == ["a3", "a1"]
    assert [t.candidate_id for t in b.traps(None)] == ["b1", "a4", "a2"]
    b.post(_f("a3", Status.correct_slower, -0.2, family="f.a"))  # a second lesson on a win stays a win
    assert "a3" not in {t.candidate_id for t in b.traps(None)}
    assert b.is_win("a3") and b.is_win("a1") and not b.is_win("a2") and not b.is_win("b1")
    assert not b.is_win("never-posted")


def test_the_leaderboard_shows_each_agents_best_whatever_the_memory(tmp_path):
    b = Board(tmp_path / "board.jsonl")
    mk = lambda cid, agent, status, gain: Finding(agent=agent, strategy="exploit", candidate_id=cid,  # noqa: E731
                                                  family="f.a", knobs={"X": cid}, status=status, gain=gain,
                                                  lesson="l")  # fmt: skip
    b.post(mk("a-slow", "a0", Status.correct_slower, -0.6), conditions=Conditions(champion_id="ref"))
    b.post(mk("a-best", "a0", Status.correct_slower, -0.2), conditions=Conditions(champion_id="ref"))
    b.post(mk("b-best", "a1", Status.correct_slower, -0.4), conditions=Conditions(champion_id="ref"))
    b.post(mk("b-bad", "a1", Status.compile_error, None), conditions=Conditions(champion_id="ref"))
    b.post(mk("c-bad", "a2", Status.incorrect, None), conditions=Conditions(champion_id="ref"))
    assert [e.candidate_id for e in b.leaderboard()] == ["a-best", "b-best"]  # no correct kernel: no row
    assert b.view(0) == [] and len(Board(tmp_path / "board.jsonl").leaderboard()) == 2  # kept on resume
