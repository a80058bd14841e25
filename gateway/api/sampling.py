"""The sampler's settings for a request: what it asked for, else the model's defaults, else ours.
Decided here once for every protocol; adapters only translate their fields into `Sampling`."""

from __future__ import annotations

from typing import TypeVar

from engines.base import SamplingParams
from gateway.conversation import Sampling
from gateway.models.registry import ModelSpec

# Like llama-server and Ollama we cut to the 40 likeliest tokens unless the request or models.yaml
# says otherwise (top_k: 0 turns it off). Besides being their default, it keeps top-p from sorting
# the whole vocabulary for every sequence at every step, which the profile showed was most of a
# decode step on a GPU at 16 streams.
DEFAULT_TOP_K = 40

T = TypeVar("T")


def _pick(asked: T | None, default: T | None, fallback: T) -> T:
    if asked is not None:
        return asked
    return default if default is not None else fallback


def resolve(asked: Sampling, spec: ModelSpec) -> SamplingParams:
    d = spec.defaults
    return SamplingParams(
        temperature=_pick(asked.temperature, d.temperature, 1.0),
        top_p=_pick(asked.top_p, d.top_p, 1.0),
        top_k=_pick(asked.top_k, d.top_k, DEFAULT_TOP_K),
        min_p=_pick(asked.min_p, d.min_p, 0.0),
        repeat_penalty=_pick(asked.repeat_penalty, d.repeat_penalty, 1.0),
        seed=asked.seed if asked.seed is not None else d.seed,
        presence_penalty=_pick(asked.presence_penalty, d.presence_penalty, 0.0),
        frequency_penalty=_pick(asked.frequency_penalty, d.frequency_penalty, 0.0),
        max_tokens=asked.max_tokens if asked.max_tokens is not None else d.max_tokens,
        stop=asked.stop or tuple(d.stop),
        logit_bias=asked.logit_bias,
        ignore_eos=asked.ignore_eos,
        logprobs=asked.logprobs,
        top_logprobs=asked.top_logprobs,
        prompt_logprobs=asked.prompt_logprobs,
    )
