"""AnthropicAgent against a local fake Messages API (tests/fake_anthropic.py): no network, no key."""

from __future__ import annotations

import ast
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# tests/ is on sys.path: pytest imports test modules of a package-less folder with that folder prepended
from fake_anthropic import (
    error_reply,
    fake_anthropic_server,
    kernel_reply,
    overloaded,
    rate_limited,
    server_error,
    slow,
    text_reply,
    truncated_reply,
    two_tool_calls_reply,
    unauthorized,
    usage,
)

from kernelarc.agents.base import AgentContext, Proposal
from kernelarc.agents.briefs import STRATEGIES, load_brief
from kernelarc.agents.llm import (
    AgentConfigError,
    AnthropicAgent,
    knob_space_of,
    knob_values_of,
    render_with_knobs,
    trim_error,
)
from kernelarc.models import Candidate, Finding, Status, Verdict, WorkloadResult
from kernelarc.tasks.loader import load_builtin

KEY = "sk-ant-api03-TESTSECRET-0123456789abcdefXYZ"
MODEL = "claude-test-model"
PRICING = {MODEL: {"input": 3.0, "output": 15.0, "cache_write": 3.75, "cache_read": 0.3}}
BRIEF = "BRIEF-MARKER: tile for the tensor cores."

SRC = """import torch


def run(x, weight):
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (xf * inv * weight.float()).to(x.dtype)
"""
SRC2 = SRC.replace("1e-6", "0.000001")
SRC3 = SRC.replace("xf = x.float()", "xf = x.to(torch.float32)")

TRITON_SRC = '''"""RMSNorm, one program per row."""
import torch
import triton
import triton.language as tl

BLOCK_N = 1024  # columns per program
NUM_WARPS: int = 4
num_stages = 2
KNOBS = {"BLOCK_N": [256, 512, 1024, 2048], "NUM_WARPS": [2, 4, 8], "num_stages": [1, 2, 3]}


@triton.jit
def _rms(x_ptr, w_ptr, y_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + 1e-6)
    tl.store(y_ptr + row * n + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=m)


def run(x, weight):
    y = torch.empty_like(x)
    _rms[(x.shape[0],)](x, weight, y, x.shape[1], BLOCK=BLOCK_N, num_warps=NUM_WARPS, num_stages=num_stages)
    return y
'''


@dataclass
class Target:
    """A minimal stand-in with only the fields the brief names (the agent must cope with it)."""

    name: str = "h200"
    arch: str = "sm_90a"
    sm_count: int = 132
    peak_tflops: dict = field(default_factory=lambda: {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0})
    hbm_tbps: float = 4.8


def test_prompt_with_the_real_gpu_target(server, task):
    from kernelarc.hardware import KNOWN_TARGETS

    server.push(kernel_reply(SRC))
    assert make_agent().propose(make_ctx(task, target=KNOWN_TARGETS["b200"]), 1).candidates
    system = server.requests[0].system_text
    assert "sm_100a" in system and "148" in system and "8 TB/s" in system and "L2 126.5 MB" in system


@pytest.fixture(autouse=True)
def _deadline():
    """No test may hang: fail after 20 s."""

    def boom(*_):
        raise TimeoutError("test exceeded 20 s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def task():
    return load_builtin("rmsnorm", cpu=True)


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    for var in ("ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_PROFILE", "ANTHROPIC_CUSTOM_HEADERS"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def server(env):
    with fake_anthropic_server() as srv:
        env.setenv("ANTHROPIC_BASE_URL", srv.base_url)
        yield srv


def make_agent(**kw) -> AnthropicAgent:
    args = dict(
        name="agent0-tiling",
        strategy="tiling",
        brief=BRIEF,
        model=MODEL,
        max_tokens=4096,
        temperature=0.7,
        pricing=PRICING,
        timeout=5.0,
        max_retries=0,
        backoff_retries=1,
        backoff_base=0.01,
        backoff_max=0.5,
        strict_response_validation=True,
    )
    args.update(kw)
    return AnthropicAgent(**args)


def make_ctx(task, **kw) -> AgentContext:
    args = dict(
        task=task, target=Target(), champion=None, champion_verdict=None, findings=[], history=[], seen=frozenset()
    )
    args.update(kw)
    return AgentContext(**args)


def verdict(cand: Candidate, status: Status, **kw) -> Verdict:
    return Verdict(candidate_id=cand.id, status=status, **kw)


def key_header(req) -> str:
    return req.headers.get("x-api-key") or req.headers.get("authorization", "")


# ----------------------------------------------------------------------------- parsing


def test_valid_reply_becomes_candidate_and_request_is_well_formed(server, task):
    server.push(kernel_reply(SRC, "", rationale="fp32 math in one pass\nsecond line"))
    agent = make_agent()
    prop = agent.propose(make_ctx(task), 1)
    assert isinstance(prop, Proposal)
    assert prop.failures == []
    assert len(prop.candidates) == 1
    c = prop.candidates[0]
    assert c.source == SRC and c.language == "pytorch"
    assert c.agent == "agent0-tiling" and c.strategy == "tiling"
    assert c.rationale == "fp32 math in one pass second line"  # one line
    assert c.parent is None and c.knobs == {}
    assert prop.conclusions == []  # nothing to conclude about yet

    (req,) = server.requests
    body = req.body
    assert body["model"] == MODEL and body["max_tokens"] == 4096 and body["temperature"] == 0.7
    # static system blocks, cache_control on the last one only
    blocks = body["system"]
    assert len(blocks) >= 2
    assert blocks[-1]["cache_control"] == {"type": "ephemeral"}
    assert all("cache_control" not in b for b in blocks[:-1])
    system = req.system_text
    assert "rmsnorm" in system and "def run(x, weight)" in system  # definition + reference
    assert "M=8, N=64" in system and "atol" in system  # workloads with axes, tolerances
    assert "h200" in system and "132" in system and "4.8 TB/s" in system  # target ceilings
    assert BRIEF in system
    assert "KNOBS" in system  # knob instructions (knob_tuning on by default)
    assert "subprocess" in system  # the rules
    # forced structured reply
    assert body["tool_choice"]["type"] == "tool" and body["tool_choice"]["name"] == "submit_kernel"
    (tool,) = body["tools"]
    props = tool["input_schema"]["properties"]
    assert props["language"]["enum"] == ["triton", "cutlass", "pytorch"]
    assert {"source", "language", "conclusion", "rationale", "knobs"} <= set(props)
    # the key is sent, in a header
    assert KEY in key_header(req)
    assert "No champion" in req.user_text or "none yet" in req.user_text


def test_system_prompt_is_static_across_calls(server, task):
    server.push(kernel_reply(SRC), kernel_reply(SRC2))
    agent = make_agent()
    a = agent.propose(make_ctx(task), 1).candidates[0]
    v = verdict(a, Status.incorrect, errors=["mismatch on workload 0"])
    f = Finding(agent="x", strategy="memory", candidate_id="c1", status=Status.correct_slower, lesson="LESSON-1")
    agent.propose(make_ctx(task, history=[(a, v)], findings=[f], seen=frozenset({a.id})), 1)
    r1, r2 = server.requests
    assert r1.body["system"] == r2.body["system"]  # cacheable prefix
    assert r1.body["tools"] == r2.body["tools"]
    assert "LESSON-1" not in r2.system_text and "LESSON-1" in r2.user_text


def test_dynamic_prompt_has_champion_history_board_redirect(server, task):
    champ = Candidate(source=SRC3, language="pytorch", agent="agent1-memory", strategy="memory")
    champ_v = Verdict(
        candidate_id=champ.id,
        status=Status.champion,
        latency_ms=0.0123,
        speedup_vs_baseline=1.87,
        sol_fraction=0.42,
        workloads=[
            WorkloadResult(index=0, axes={"M": 8, "N": 64}, latency_ms=0.01, sol_fraction=0.4, sol_bound="memory")
        ],
    )
    prev = Candidate(source=SRC2, language="pytorch", agent="agent0-tiling", strategy="tiling", rationale="try it")
    frames = "".join(
        f'  File "/usr/lib/python3.11/site-packages/torch/_lib{i}.py", line {i}, in f{i}\n    call_{i}()\n'
        for i in range(200)
    )
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/tmp/cand/kernel.py", line 7, in run\n    return (xf * inv).to(x.dtype)\n'
        + frames
        + "RuntimeError: The size of tensor a (64) must match the size of tensor b (100) FINAL-LINE"
    )
    prev_v = Verdict(candidate_id=prev.id, status=Status.runtime_error, errors=[tb])
    findings = [
        Finding(
            agent="agent2-fusion",
            strategy="fusion",
            candidate_id="abc",
            status=Status.correct_slower,
            gain=-0.12,
            lesson="two launches cost more than they save BOARD-LESSON",
        )
    ]
    ctx = make_ctx(
        task,
        champion=champ,
        champion_verdict=champ_v,
        findings=findings,
        history=[(prev, prev_v)],
        seen=frozenset({champ.id, prev.id}),
        redirect="explore a persistent design REDIRECT-MARK",
        budget_left=17,
    )
    server.push(kernel_reply(SRC, "shape mismatch: broadcast weight over rows"))
    prop = make_agent().propose(ctx, 1)
    assert len(prop.candidates) == 1 and prop.candidates[0].parent == champ.id
    user = server.requests[0].user_text
    assert SRC3.strip() in user  # champion source
    assert "0.0123 ms" in user and "1.87x" in user and "42.0%" in user  # champion metrics
    assert "runtime_error" in user and "FINAL-LINE" in user and "kernel.py" in user  # verdict feedback
    assert "site-packages/torch/_lib150.py" not in user  # library frames trimmed
    assert "BOARD-LESSON" in user and "-12.0%" in user
    assert "REDIRECT-MARK" in user
    assert "17 candidate evaluations" in user
    assert prev.id in user and SRC2.strip() in user  # previous attempt with its source
    assert prop.conclusions == [(prev.id, "shape mismatch: broadcast weight over rows")]


# ----------------------------------------------------------------------------- repair


MALFORMED = {
    "text_only": lambda: text_reply("Here is a kernel:\n```python\n" + SRC + "```"),
    "two_tool_calls": lambda: two_tool_calls_reply(SRC, SRC2),
    "invalid_python": lambda: kernel_reply("def run(x, weight):\n    return x +\n"),
    "wrong_language": lambda: kernel_reply(SRC, language="cuda"),
    "truncated": lambda: truncated_reply(SRC),
    "no_run": lambda: kernel_reply("import torch\n\ndef main(x, weight):\n    return x\n"),
    "two_files": lambda: kernel_reply("# file: a.py\n" + SRC + "\n# file: b.py\nX = 1\n"),
    "empty_source": lambda: kernel_reply("   "),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_reply_gets_one_repair_turn(server, task, kind):
    server.push(MALFORMED[kind](), kernel_reply(SRC3, language="pytorch"))
    prop = make_agent().propose(make_ctx(task), 1)
    assert prop.failures == [], prop.failures
    assert [c.source for c in prop.candidates] == [SRC3]
    assert len(server.requests) == 2
    first, second = server.requests
    msgs = second.body["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[0] == first.body["messages"][0]
    repair = msgs[2]["content"]
    if any(b["type"] == "tool_use" for b in msgs[1]["content"]):
        assert all(b["type"] == "tool_result" and b["is_error"] is True for b in repair)
        assert {b["tool_use_id"] for b in repair} == {b["id"] for b in msgs[1]["content"] if b["type"] == "tool_use"}
    else:
        assert repair[0]["type"] == "text"
    assert "rejected" in second.user_text
    assert prop.cost["calls"] == 2


def test_malformed_twice_is_a_recorded_failure(server, task):
    server.push(text_reply("no tool"), kernel_reply("def run(x, weight):\n  return (\n"))
    agent = make_agent()
    prop = agent.propose(make_ctx(task), 1)  # never raises
    assert prop.candidates == []
    assert len(prop.failures) == 1 and "malformed" in prop.failures[0] and "not valid Python" in prop.failures[0]
    assert len(server.requests) == 2  # exactly one repair turn
    server.push(kernel_reply(SRC))
    assert len(agent.propose(make_ctx(task), 1).candidates) == 1  # keeps working


def test_fenced_single_file_is_unwrapped(server, task):
    server.push(kernel_reply("```python\n" + SRC + "```"))
    prop = make_agent().propose(make_ctx(task), 1)
    assert prop.failures == [] and prop.candidates[0].source.strip() == SRC.strip()


def test_duplicate_of_seen_candidate_is_repaired(server, task):
    seen = Candidate(source=SRC, language="pytorch")
    server.push(kernel_reply(SRC), kernel_reply(SRC2))
    prop = make_agent().propose(make_ctx(task, seen=frozenset({seen.id})), 1)
    assert [c.source for c in prop.candidates] == [SRC2]
    assert "already proposed" in server.requests[1].user_text


def test_n_candidates_in_one_round(server, task):
    server.push(kernel_reply(SRC, rationale="first idea"), kernel_reply(SRC2, rationale="second idea"))
    prop = make_agent().propose(make_ctx(task), 2)
    assert [c.source for c in prop.candidates] == [SRC, SRC2]
    assert prop.candidates[0].id in server.requests[1].user_text  # told what it already proposed
    assert prop.cost["calls"] == 2


# ----------------------------------------------------------------------------- robustness


@pytest.mark.parametrize("outage", [server_error, overloaded, lambda: server_error(503)])
def test_outage_is_recorded_then_next_call_works(server, task, outage):
    server.push(outage(), outage())  # 1 attempt + 1 backoff retry, SDK retries off
    agent = make_agent()
    prop = agent.propose(make_ctx(task), 2)
    assert prop.candidates == []
    assert len(prop.failures) == 1 and "API error" in prop.failures[0]
    assert len(server.requests) == 2  # stopped the round after the outage
    server.push(kernel_reply(SRC))
    prop2 = agent.propose(make_ctx(task), 1)
    assert len(prop2.candidates) == 1 and prop2.failures == []


def test_sdk_retries_are_used(server, task):
    server.push(server_error(), overloaded(), kernel_reply(SRC))
    agent = make_agent(max_retries=2, backoff_retries=0, backoff_max=0.05)
    prop = agent.propose(make_ctx(task), 1)
    assert len(prop.candidates) == 1 and prop.failures == []
    assert len(server.requests) == 3


def test_timeout_is_retried(server, task):
    server.push(slow(kernel_reply(SRC), 30.0), kernel_reply(SRC2))
    agent = make_agent(timeout=0.3)
    t0 = time.monotonic()
    prop = agent.propose(make_ctx(task), 1)
    assert time.monotonic() - t0 < 15  # the slow reply was not waited for (a wide bound: CI is shared)
    assert [c.source for c in prop.candidates] == [SRC2]


def test_timeout_outage_recorded(server, task):
    server.push(slow(kernel_reply(SRC), 3.0), slow(kernel_reply(SRC), 3.0))
    prop = make_agent(timeout=0.2).propose(make_ctx(task), 1)
    assert prop.candidates == [] and "Timeout" in prop.failures[0]


def test_connection_error_is_a_failure_not_a_crash(env, task):
    env.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")  # discard port: refused
    prop = make_agent(timeout=1.0).propose(make_ctx(task), 1)
    assert prop.candidates == [] and "Connection" in prop.failures[0]


def test_429_retry_after_is_honoured(server, task):
    server.push(rate_limited(0.3), kernel_reply(SRC))
    prop = make_agent(backoff_base=0.0).propose(make_ctx(task), 1)
    assert len(prop.candidates) == 1 and prop.failures == []
    t = server.request_times
    assert t[1] - t[0] >= 0.3


def test_429_retry_after_is_honoured_by_sdk_retries_too(server, task):
    server.push(rate_limited(0.3), kernel_reply(SRC))
    prop = make_agent(max_retries=1, backoff_retries=0).propose(make_ctx(task), 1)
    assert len(prop.candidates) == 1
    t = server.request_times
    assert t[1] - t[0] >= 0.3


def test_retry_after_is_bounded(server, task):
    server.push(rate_limited(3600), rate_limited(3600), kernel_reply(SRC))
    t0 = time.monotonic()
    prop = make_agent(max_retries=1, backoff_retries=1, backoff_max=0.2).propose(make_ctx(task), 1)
    assert time.monotonic() - t0 < 30  # not the hour asked for (a wide bound: CI is shared)
    assert len(prop.candidates) == 1


def test_other_4xx_is_not_retried(server, task):
    server.push(error_reply(400, "invalid_request_error", "prompt is too long"))
    prop = make_agent().propose(make_ctx(task), 1)
    assert "prompt is too long" in prop.failures[0] and len(server.requests) == 1


def test_401_raises_clear_config_error_without_key(server, task):
    server.push(unauthorized())
    agent = make_agent(max_retries=2, backoff_retries=2)
    with pytest.raises(AgentConfigError) as ei:
        agent.propose(make_ctx(task), 1)
    msg = str(ei.value)
    assert "ANTHROPIC_API_KEY" in msg and "401" in msg and "agents.backend=search" in msg
    assert KEY not in msg and KEY not in repr(ei.value)
    assert ei.value.__cause__ is None and ei.value.__suppress_context__
    assert len(server.requests) == 1  # not retried


def test_missing_key_raises_at_construction(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(AgentConfigError, match="ANTHROPIC_API_KEY") as ei:
        make_agent()
    assert "agents.backend=search" in str(ei.value)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "  ")
    with pytest.raises(AgentConfigError):
        make_agent()


def test_base_url_argument_overrides_env(env, task):
    env.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
    with fake_anthropic_server([kernel_reply(SRC)]) as (url, requests):
        prop = make_agent(base_url=url).propose(make_ctx(task), 1)
        assert len(prop.candidates) == 1 and len(requests) == 1


# ----------------------------------------------------------------------------- cost


def test_cost_accounting(server, task):
    server.push(
        text_reply("oops", usage_=usage(1000, 100, cache_creation_input_tokens=5000)),
        kernel_reply(SRC, usage_=usage(200, 800, cache_read_input_tokens=5000)),
    )
    prop = make_agent().propose(make_ctx(task), 1)
    c = prop.cost
    assert c["input_tokens"] == 1200 and c["output_tokens"] == 900
    assert c["cache_creation_input_tokens"] == 5000 and c["cache_read_input_tokens"] == 5000
    assert c["calls"] == 2
    expected = (1200 * 3.0 + 900 * 15.0 + 5000 * 3.75 + 5000 * 0.3) / 1e6
    assert c["usd"] == pytest.approx(expected)
    assert set(c) == {
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "usd",
        "calls",
    }


def test_cost_prefix_pricing_and_unknown_model(server, task):
    server.push(kernel_reply(SRC, usage_=usage(1_000_000, 0)), kernel_reply(SRC2, usage_=usage(1_000_000, 0)))
    a = make_agent(model="claude-test-model-20260101", pricing={"claude-test-model": {"input": 2.0, "output": 1.0}})
    assert a.propose(make_ctx(task), 1).cost["usd"] == pytest.approx(2.0)
    b = make_agent(pricing={})
    p = b.propose(make_ctx(task), 1)
    assert p.cost["usd"] == 0 and p.cost["input_tokens"] == 1_000_000


# ----------------------------------------------------------------------------- conclusions


def test_conclusions_flow_once_per_previous_attempt(server, task):
    prev = Candidate(source=SRC2, language="pytorch", agent="agent0-tiling", strategy="tiling")
    hist = [(prev, verdict(prev, Status.correct_slower, latency_ms=0.5, speedup_vs_champion=0.8))]
    long = "slower: two passes over x\n" + "because " * 60
    server.push(kernel_reply(SRC, long), kernel_reply(SRC3, "again"))
    agent = make_agent()
    ctx = make_ctx(task, history=hist, seen=frozenset({prev.id}))
    prop = agent.propose(ctx, 1)
    ((cid, text),) = prop.conclusions
    assert cid == prev.id and "\n" not in text and len(text) <= 200 and text.startswith("slower: two passes")
    assert "what your previous attempt" in server.requests[0].user_text
    prop2 = agent.propose(make_ctx(task, history=hist, seen=frozenset({prev.id, prop.candidates[0].id})), 1)
    assert prop2.conclusions == []  # already concluded about prev


def test_conclusion_uses_observed_verdicts(server, task):
    agent = make_agent()
    server.push(kernel_reply(SRC, ""))
    first = agent.propose(make_ctx(task), 1).candidates[0]
    assert agent.observe(first, verdict(first, Status.incorrect, errors=["max_abs_err 3.2 > atol"])) is None
    server.push(kernel_reply(SRC2, "forgot the weight"))
    prop = agent.propose(make_ctx(task, seen=frozenset({first.id})), 1)
    assert prop.conclusions == [(first.id, "forgot the weight")]
    assert "max_abs_err 3.2" in server.requests[-1].user_text


def test_conclusion_salvaged_from_rejected_reply(server, task):
    prev = Candidate(source=SRC2, language="pytorch")
    hist = [(prev, verdict(prev, Status.compile_error, errors=["SyntaxError"]))]
    server.push(kernel_reply("def run(:", "lesson kept"), text_reply("still no tool"))
    prop = make_agent().propose(make_ctx(task, history=hist), 1)
    assert prop.candidates == [] and prop.conclusions == [(prev.id, "lesson kept")]


# ----------------------------------------------------------------------------- secrets


def test_key_never_leaks(server, task, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, including the SDK's and httpx's
    prev = Candidate(source=SRC2, language="pytorch")
    server.push(
        rate_limited(0.01),
        error_reply(500, "api_error", f"upstream echoed {KEY}"),  # a hostile server echoing the key
        error_reply(500, "api_error", f"upstream echoed {KEY}"),
        text_reply(f"my key is {KEY}"),
        kernel_reply(SRC, f"conclusion with {KEY}", rationale=f"rationale {KEY}"),
    )
    agent = make_agent(max_retries=0, backoff_retries=1)
    ctx = make_ctx(task, history=[(prev, verdict(prev, Status.incorrect))])
    p1 = agent.propose(ctx, 1)  # 429, then 500 echoing the key: outage recorded
    p2 = agent.propose(ctx, 1)  # 500 echoing the key, then a text reply echoing it, repaired
    assert p1.failures and not p1.candidates
    assert p2.candidates and not p2.failures
    server.push(unauthorized())
    with pytest.raises(AgentConfigError) as ei:
        agent.propose(ctx, 1)
    for text in (caplog.text, repr(agent), str(agent), repr(p1), repr(p2), str(ei.value), repr(ei.value)):
        assert KEY not in text
    assert all(KEY not in c for _, c in p1.conclusions + p2.conclusions)
    assert KEY in key_header(server.requests[0])  # it was sent, as a header
    assert any("retrying" in r.getMessage() for r in caplog.records)  # logs did happen


# ----------------------------------------------------------------------------- knobs


def test_knob_space_and_render():
    space = knob_space_of(TRITON_SRC)
    assert space == {"BLOCK_N": [256, 512, 1024, 2048], "NUM_WARPS": [2, 4, 8], "num_stages": [1, 2, 3]}
    assert knob_space_of(Candidate(source=TRITON_SRC, language="triton")) == space
    assert knob_values_of(TRITON_SRC) == {"BLOCK_N": 1024, "NUM_WARPS": 4, "num_stages": 2}
    out = render_with_knobs(TRITON_SRC, {"BLOCK_N": 2048, "NUM_WARPS": 8, "num_stages": 3})
    assert "BLOCK_N = 2048  # columns per program" in out  # comments kept
    assert "NUM_WARPS: int = 8" in out and "\nnum_stages = 3\n" in out
    assert knob_values_of(out) == {"BLOCK_N": 2048, "NUM_WARPS": 8, "num_stages": 3}
    assert knob_space_of(out) == space  # the KNOBS literal is untouched
    ast.parse(out)
    # only those lines changed
    diff = [(a, b) for a, b in zip(TRITON_SRC.splitlines(), out.splitlines(), strict=True) if a != b]
    assert len(diff) == 3
    assert render_with_knobs(TRITON_SRC, {}) == TRITON_SRC
    with pytest.raises(ValueError, match="unknown knob"):
        render_with_knobs(TRITON_SRC, {"BLOCK_M": 64})
    with pytest.raises(ValueError, match="not in"):
        render_with_knobs(TRITON_SRC, {"BLOCK_N": 4096})
    with pytest.raises(ValueError, match="not in"):
        render_with_knobs(TRITON_SRC, {"NUM_WARPS": 4.0})  # type-strict
    with pytest.raises(ValueError):
        render_with_knobs(SRC, {"BLOCK_N": 256})  # no KNOBS literal


def test_knob_space_edge_cases():
    # lower-case knob name reads the UPPER_CASE constant; current value not listed is added
    src = "block = 3\nBLOCK = 64\nKNOBS = {'block': [128, 256]}\ndef run(x):\n    return x\n"
    assert knob_space_of(src) == {"block": [3, 128, 256]}  # 'block' itself is a simple constant
    src = "BLOCK = 64\nKNOBS = {'block': [128, 256]}\ndef run(x):\n    return x\n"
    assert knob_space_of(src) == {"block": [64, 128, 256]}
    assert "BLOCK = 128" in render_with_knobs(src, {"block": 128})
    # rebound or non-literal constants are not knobs
    src = "A = 1\nA = 2\nB = 3\nB += 1\nC = 2 * 4\nD = 1\nE = 5\n"
    src += "KNOBS = {'A': [1], 'B': [3], 'C': [8], 'D': [1, 2], 'E': [5]}\n"
    src += "def f():\n    global E\n    E = 6\ndef run(x):\n    return x\n"
    assert knob_space_of(src) == {"D": [1, 2]}
    # KNOBS must be a dict literal
    assert knob_space_of("K = 1\nKNOBS = dict(K=[1, 2])\n") == {}
    assert knob_space_of("def run(:\n") == {}
    # non-ASCII text before the constant (byte offsets vs character offsets)
    src = "# naïve — ünïcödé\nTILE = 'ä'\nKNOBS = {'TILE': ['ä', 'ö']}\n"
    assert render_with_knobs(src, {"TILE": "ö"}) == src.replace("TILE = 'ä'", "TILE = 'ö'")
    # tuple-valued knobs
    src = "TILE = (128, 64)\nKNOBS = {'TILE': [(128, 64), (64, 64)]}\n"
    assert "TILE = (64, 64)" in render_with_knobs(src, {"TILE": (64, 64)})


def test_reply_knobs_fill_candidate_knobs(server, task):
    triton_src = TRITON_SRC.replace(
        'KNOBS = {"BLOCK_N": [256, 512, 1024, 2048], "NUM_WARPS": [2, 4, 8], "num_stages": [1, 2, 3]}\n', ""
    )
    assert knob_space_of(triton_src) == {}
    server.push(
        kernel_reply(
            triton_src, language="triton", knobs={"BLOCK_N": [512, 1024], "NUM_WARPS": [4, 8], "MISSING": [1, 2]}
        )
    )
    (c,) = make_agent().propose(make_ctx(task), 1).candidates
    assert c.language == "triton"
    assert c.knobs == {"BLOCK_N": 1024, "NUM_WARPS": 4}
    assert knob_space_of(c) == {"BLOCK_N": [512, 1024], "NUM_WARPS": [4, 8]}  # KNOBS literal was added
    variant = render_with_knobs(c.source, {"BLOCK_N": 512})
    assert knob_values_of(variant)["BLOCK_N"] == 512
    # the literal in the file wins over the reply's field; without knob_tuning no knobs at all
    server.push(kernel_reply(TRITON_SRC, language="triton", knobs={"BLOCK_N": [1024]}))
    (c2,) = make_agent(knob_tuning=False).propose(make_ctx(task), 1).candidates
    assert c2.knobs == {} and c2.source == TRITON_SRC
    assert "knobs" not in server.requests[-1].body["tools"][0]["input_schema"]["properties"]
    assert "KNOBS" not in server.requests[-1].system_text


# ----------------------------------------------------------------------------- helpers


def test_trim_error_keeps_the_useful_lines():
    lines = "\n".join(
        f"workload {i}: mismatch max_abs_err {i * 0.1:.3f} > atol 0.02, matched 0.{i}1 < 1.0" for i in range(300)
    )
    out = trim_error(lines)
    assert len(out) <= 1500 and "workload 0:" in out and "similar line" in out
    tb = "Traceback (most recent call last):\n" + "".join(
        f'  File "/opt/venv/lib/python3.11/site-packages/triton/x{i}.py", line 1, in g\n    g()\n' for i in range(100)
    )
    tb += "triton.compiler.errors.CompilationError: at 12:4:\n    acc += tl.dot(a, b)\n    ^\nshape mismatch THE-END"
    out = trim_error(tb)
    assert "THE-END" in out and "CompilationError" in out and "library frame" in out and len(out) <= 1500
    assert trim_error("\x1b[31mred\x1b[0m") == "red"
    assert len(trim_error("x" * 10_000)) <= 1500


def test_briefs():
    for s in STRATEGIES:
        text = load_brief(s)
        assert text.strip() and len(text.splitlines()) <= 60
        assert "Hopper" in text and "Blackwell" in text
    with pytest.raises(ValueError):
        load_brief("vibes")


def test_brief_override(tmp_path: Path):
    f = tmp_path / "mine.md"
    f.write_text("my own tiling brief\n")
    assert load_brief("tiling", f) == "my own tiling brief\n"
    d = tmp_path / "briefs"
    d.mkdir()
    (d / "memory.md").write_text("custom memory\n")
    assert load_brief("memory", d) == "custom memory\n"
    assert load_brief("tiling", d) == load_brief("tiling")  # not in the folder: shipped one
    with pytest.raises(FileNotFoundError):
        load_brief("tiling", tmp_path / "nope.md")
    (d / "fusion.md").write_text("   \n")
    with pytest.raises(ValueError):
        load_brief("fusion", d)


def test_a_dispatch_champion_is_summarised_not_pasted_whole(task):
    from kernelarc.agents.llm import build_user_prompt

    part = Candidate(source="import torch\n\n\ndef run(x, w):\n    return x  # PART-DEFAULT\n", language="pytorch",
                     family="rmsnorm.rowblock")  # fmt: skip
    comp = Candidate(source="# COMPOSITE-BODY\n" + "x = 1\n" * 2000, language="triton", family="dispatch",
                     knobs={"default": part.id, "workload0": part.id, "workload1": "abc"})  # fmt: skip
    v = verdict(comp, Status.champion, correct=True, latency_ms=0.1)
    ctx = make_ctx(task, champion=comp, champion_verdict=v, backups=[(part, verdict(part, Status.correct_slower))])
    text = build_user_prompt(ctx, [], strategy="tiling")
    assert "COMPOSITE-BODY" not in text and "PART-DEFAULT" in text
    assert "shape dispatch" in text and "workload1: abc" in text
