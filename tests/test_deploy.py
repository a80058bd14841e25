"""deploy/ checked with the real tools: promtool, a real Prometheus scraping a running gateway."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.conftest import MODEL, ROOT, free_port, wait_for

DEPLOY = ROOT / "deploy"


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed (scripts/test.sh installs Debian's 'prometheus' package)"
    return path


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_check_config() -> None:
    for cfg in ("prometheus.yml", "prometheus.compose.yml"):
        path = DEPLOY / "prometheus" / cfg
        if cfg == "prometheus.compose.yml" and not path.exists():
            continue
        r = _run(_tool("promtool"), "check", "config", "--syntax-only", str(path))
        assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_rules() -> None:
    r = _run(_tool("promtool"), "check", "rules", str(DEPLOY / "prometheus" / "rules.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_rule_unit_tests() -> None:
    r = _run(_tool("promtool"), "test", "rules", "rules_test.yml", cwd=ROOT / "tests" / "prometheus")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_rules_use_slo_thresholds_from_metrics_module() -> None:
    from gateway.metrics import SLO_TPOT_S, SLO_TTFT_S

    rules = {r.get("alert"): r for g in yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"] for r in g["rules"]}
    assert rules["GatewayTTFTSLOBreach"]["expr"].endswith(f"> {SLO_TTFT_S}")
    assert rules["GatewayTPOTSLOBreach"]["expr"].endswith(f"> {SLO_TPOT_S}")


@pytest.fixture(scope="module")
def prometheus(gateway_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("prom")
    port = free_port()
    target = gateway_url.removeprefix("http://")
    cfg = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DEPLOY / "prometheus" / "rules.yml")],
        "scrape_configs": [{"job_name": "llm-gateway", "static_configs": [{"targets": [target]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [_tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_for(f"{url}/-/ready", 60):
            raise RuntimeError("prometheus did not start: " + (tmp / "prometheus.log").read_text()[-2000:])
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _query(prom: str, expr: str) -> dict[str, Any]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body: dict[str, Any] = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body


def test_prometheus_reads_ttft_quantile_from_gateway(prometheus: str, client: openai.OpenAI) -> None:
    expr = f'histogram_quantile(0.95, sum by (le) (rate(gateway_time_to_first_token_seconds_bucket{{model="{MODEL}"}}[1m])))'
    value = None
    # Requests spread over several scrapes, so the series exist before they increase.
    for i in range(30):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Count {i}"}], max_tokens=4, temperature=0)
        time.sleep(1.0)
        result = _query(prometheus, expr)["data"]["result"]
        if i >= 2 and result and result[0]["value"][1] != "NaN":
            value = float(result[0]["value"][1])
            break
    assert value is not None, "no TTFT quantile in Prometheus"
    assert 0 < value <= 60
    count = _query(prometheus, f'gateway_time_to_first_token_seconds_count{{model="{MODEL}"}}')["data"]["result"]
    gateway_count = float(next(
        line.split()[-1] for line in httpx.get(_target_url(prometheus) + "/metrics").text.splitlines()
        if line.startswith("gateway_time_to_first_token_seconds_count")
    ))
    assert float(count[0]["value"][1]) <= gateway_count
    up = _query(prometheus, 'up{job="llm-gateway"}')["data"]["result"]
    assert up and up[0]["value"][1] == "1"


def _target_url(prom: str) -> str:
    target = httpx.get(f"{prom}/api/v1/targets").json()["data"]["activeTargets"][0]["scrapeUrl"]
    return str(target).removesuffix("/metrics")


def test_rules_load_healthy_in_prometheus(prometheus: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        groups = httpx.get(f"{prometheus}/api/v1/rules").json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("2") and r["health"] != "unknown" for r in rules):
            break
        assert time.monotonic() < deadline, "rules never evaluated"
        time.sleep(0.5)
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "expr" and isinstance(v, str) and v:
                yield v
            else:
                yield from _exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _exprs(v)


def test_every_dashboard_query_runs(prometheus: str) -> None:
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "llm-gateway.json").read_text())
    exprs = list(_exprs(dash))
    assert len(exprs) >= 10
    for expr in exprs:
        q = (expr.replace("$__rate_interval", "1m").replace("$__range", "5m")
             .replace("$model", ".*").replace("$engine", ".*").replace("$device", ".*"))
        _query(prometheus, q)
