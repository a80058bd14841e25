"""Agents against the gateway, unchanged: the OpenAI Agents SDK (Responses API by default) runs an
agent with a function tool to its final output, and Codex CLI (which speaks only the Responses API)
runs `codex exec` to an answer and exit 0 on the models.yaml entry made for coding agents."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from tests.conftest import MODEL, ROOT
from tests.test_production import Gateway

AGENT_CLIS = ROOT / "tests" / "agents"  # package.json + package-lock.json; scripts/test.sh runs `npm ci` there
CODEX = AGENT_CLIS / "node_modules" / ".bin" / "codex"
CLAUDE = AGENT_CLIS / "node_modules" / ".bin" / "claude"


def _cli(path: Path) -> Path:
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing: scripts/test.sh installs it with `npm ci` in {AGENT_CLIS}")
        pytest.skip(f"{path.name} not installed: run `npm ci` in {AGENT_CLIS}")
    return path


def _run_ok(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    """Run an agent CLI to its end: exit 0 asserted, its stdout returned, its wall time printed."""
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)
    print(f"{Path(cmd[0]).name} took {time.monotonic() - start:.1f} s")
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def _clean_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_", "ANTHROPIC_", "CLAUDE_"))}
    env.update(NO_COLOR="1", **more)
    return env


def test_agents_sdk_runs_an_agent_with_a_function_tool_to_its_final_output(gateway_url: str) -> None:
    from dataclasses import replace

    from agents import (
        Agent,
        AgentHooks,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        RunResult,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)  # no traces to OpenAI's servers
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        asked.append(city)
        return f"Sunny, 21 C in {city}"

    class AnswerAfterTheTool(AgentHooks):
        # Whether a model calls a tool again under tool_choice "auto" is the model's choice (a 135M
        # model's is a near tie that batching can tip): the turn after the tool asks for an answer.
        async def on_tool_end(self, context: object, agent: Agent, tool: object, result: object) -> None:
            agent.model_settings = replace(agent.model_settings, tool_choice="none")

    async def run() -> RunResult:
        async with AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="x", max_retries=0) as client:
            # The first turn must call the tool; the SDK then runs it and asks again, with the tools
            # still listed, the call and its output in the input, and tool_choice "none": the model
            # answers from the tool's output.
            agent = Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                          model=OpenAIResponsesModel(model=MODEL, openai_client=client), reset_tool_choice=False,
                          hooks=AnswerAfterTheTool(),
                          model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=128))
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    kinds = [type(i) for i in result.new_items]
    assert asked, kinds
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_agents_sdk_runs_an_agent_without_tools(gateway_url: str) -> None:
    """An agent with no tools sends `tools: []` (and no tool_choice): OpenAI's Responses API takes
    that as no tools, and so does the gateway. The same with every SDK default: no instructions."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, RunResult, set_tracing_disabled
    from agents.items import MessageOutputItem

    set_tracing_disabled(True)
    sent: list[dict[str, object]] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/responses"):
            sent.append(json.loads(request.content))

    async def run() -> RunResult:
        async with httpx.AsyncClient(event_hooks={"request": [record]}) as http, \
                AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="x", max_retries=0, http_client=http) as client:
            agent = Agent(name="plain", model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                          model_settings=ModelSettings(temperature=0, max_tokens=256))
            return await Runner.run(agent, "Say hello in three words.", max_turns=1)

    result = asyncio.run(run())
    assert sent and sent[0].get("tools") == [], sent  # what the SDK sends for an agent without tools
    assert [type(i) for i in result.new_items] == [MessageOutputItem]
    assert isinstance(result.final_output, str) and result.final_output.strip()


@pytest.fixture(scope="module")
def agent_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = Gateway(tmp_path_factory.mktemp("agent-gateway"), "--model", "smollm2-135m-agent")
    yield g
    g.stop()


def test_a_model_without_tools_answers_in_text_and_names_the_skipped_tools(agent_gateway: Gateway) -> None:
    tool = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}
    r = httpx.post(f"{agent_gateway.url}/v1/responses", timeout=120, json={
        "model": "smollm2-135m-agent", "input": "Say hi.", "max_output_tokens": 16, "tools": [tool]})
    assert r.status_code == 200, r.text
    assert r.headers["x-skipped-tools"] == "exec_command"
    assert [o["type"] for o in r.json()["output"]] == ["message"]
    chat = httpx.post(f"{agent_gateway.url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m-agent", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 16,
        "tools": [{"type": "function", "function": {"name": "exec_command"}}]})
    assert chat.status_code == 200 and chat.headers["x-skipped-tools"] == "exec_command", chat.text
    assert chat.json()["choices"][0]["message"]["tool_calls"] is None
    # A call the model must make cannot be met: a 400 naming the field, in the protocol's envelope.
    r = httpx.post(f"{agent_gateway.url}/v1/responses", timeout=120, json={
        "model": "smollm2-135m-agent", "input": "Run ls.", "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def _codex_home(home: Path, url: str) -> None:
    home.mkdir()
    (home / "config.toml").write_text(f"""\
model = "smollm2-135m-agent"
model_provider = "gateway"
model_context_window = 8192

[model_providers.gateway]
name = "llm-gateway"
base_url = "{url}/v1"
wire_api = "responses"
""")


def test_codex_exec_answers_and_exits_0(agent_gateway: Gateway, tmp_path: Path) -> None:
    codex = _cli(CODEX)
    home, work = tmp_path / "codex-home", tmp_path / "work"
    _codex_home(home, agent_gateway.url)
    work.mkdir()
    env = _clean_env(CODEX_HOME=str(home), OPENAI_API_KEY="unused")
    out = _run_ok([str(codex), "exec", "--skip-git-repo-check", "--json", "What is 2+2?"], work, env)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    answers = [e["item"]["text"] for e in events
               if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert answers and answers[-1].strip(), out[-4000:]
    usage = next(e["usage"] for e in events if e.get("type") == "turn.completed")
    # Codex's own instructions went through whole (thousands of tokens; its tools are skipped on the
    # agent entry, which answers in text).
    assert usage["input_tokens"] > 3000, usage
    log = agent_gateway.log()
    assert '"POST /v1/responses HTTP/1.1" 200' in log, log[-3000:]


def test_claude_code_print_answers_and_exits_0(agent_gateway: Gateway, tmp_path: Path) -> None:
    """Claude Code asks for its own model names (a Claude model, and a small one for side tasks):
    models.yaml's `aliases: ["claude-*"]` on the agent entry serves them; nothing else is set."""
    claude = _cli(CLAUDE)
    work = tmp_path / "work"
    work.mkdir()
    env = _clean_env(ANTHROPIC_BASE_URL=agent_gateway.url, ANTHROPIC_API_KEY="unused", HOME=str(tmp_path),
                     CLAUDE_CONFIG_DIR=str(tmp_path / "claude-config"), DISABLE_AUTOUPDATER="1",
                     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1")
    result = json.loads(_run_ok([str(claude), "-p", "What is 2+2?", "--output-format", "json"], work, env))
    assert result.get("is_error") is False and str(result.get("result", "")).strip(), result
    log = agent_gateway.log()
    assert '"POST /v1/messages' in log and '" 200' in log, log[-3000:]
