"""/metrics agrees with what clients saw."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import E2E_BUCKETS, SLO_E2E_S, SLO_TPOT_S, SLO_TTFT_S, TOKEN_GAP_BUCKETS, TTFT_BUCKETS
from tests.conftest import MODEL

LB = {"model": MODEL, "engine": "llamacpp/cpu", "device": "cpu"}


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return m.get((name, frozenset({**LB, **labels}.items())), 0.0)


def test_slo_thresholds_are_bucket_edges() -> None:
    assert SLO_TTFT_S in TTFT_BUCKETS and SLO_TPOT_S in TOKEN_GAP_BUCKETS and SLO_E2E_S in E2E_BUCKETS


def test_metrics_match_client_view(client: openai.OpenAI, gateway_url: str) -> None:
    before = scrape(gateway_url)
    usage_prompt = usage_gen = 0
    n = 0
    for i in range(3):
        prev = scrape(gateway_url)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=5, temperature=0)
        assert r.usage is not None
        usage_prompt += r.usage.prompt_tokens
        usage_gen += r.usage.completion_tokens
        n += 1
        now = scrape(gateway_url)
        ttft = val(now, "gateway_time_to_first_token_seconds_sum") - val(prev, "gateway_time_to_first_token_seconds_sum")
        e2e = val(now, "gateway_e2e_request_latency_seconds_sum") - val(prev, "gateway_e2e_request_latency_seconds_sum")
        assert 0 < ttft <= e2e
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    u = chunks[-1].usage
    assert u is not None
    usage_prompt += u.prompt_tokens
    usage_gen += u.completion_tokens
    n += 1
    after = scrape(gateway_url)

    def delta(name: str, **labels: str) -> float:
        return val(after, name, **labels) - val(before, name, **labels)

    for h in ("gateway_time_to_first_token_seconds", "gateway_e2e_request_latency_seconds", "gateway_time_per_output_token_seconds",
              "gateway_queue_wait_seconds", "gateway_request_prompt_tokens", "gateway_request_generation_tokens"):
        assert delta(f"{h}_count") == n, h
    assert delta("gateway_prompt_tokens_total") == usage_prompt
    assert delta("gateway_generation_tokens_total") == usage_gen
    # Every gap between tokens is one ITL sample: (tokens - 1) per request.
    assert delta("gateway_inter_token_latency_seconds_count") == usage_gen - n
    finished = delta("gateway_requests_total", outcome="length", status="200") + delta("gateway_requests_total", outcome="stop", status="200")
    assert finished == n
    assert after[("gateway_models_resident", frozenset())] >= 1
    assert (("gateway_requests_running", frozenset(LB.items())) in after)
    info = [k for k in after if k[0] == "gateway_engine_build_info" and ("model", MODEL) in k[1]]
    assert info and ("backend", "cpu") in info[0][1] and ("runtime", "llamacpp") in info[0][1]


def test_errors_are_counted_by_code_and_status(gateway_url: str) -> None:
    key = ("gateway_requests_total", frozenset({"model": "", "engine": "", "device": "", "outcome": "model_not_found", "status": "404"}.items()))
    before = scrape(gateway_url).get(key, 0.0)
    httpx.post(f"{gateway_url}/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert scrape(gateway_url)[key] == before + 1
    long = {"model": MODEL, "messages": [{"role": "user", "content": "lorem ipsum " * 1500}]}
    prev = val(scrape(gateway_url), "gateway_requests_total", outcome="context_length_exceeded", status="400")
    assert httpx.post(f"{gateway_url}/v1/chat/completions", json=long, timeout=60).status_code == 400
    assert val(scrape(gateway_url), "gateway_requests_total", outcome="context_length_exceeded", status="400") == prev + 1
