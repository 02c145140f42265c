"""kvlink proxy: one prompt per request. vLLM runs each prompt of a batch as its own request with the same
kv_transfer_params, so the proxy refuses a batch before any backend sees it, in both pairing modes."""

from __future__ import annotations

import json

import pytest

from tests.proxy.test_router import post, wait_for

MODES = ["sequential", "concurrent"]


def _proxy(backends, proxy, mode):
    p, d = backends("p0"), backends("d0")
    extra = dict(prefill_bootstrap=("http://127.0.0.1:1",), prefill_engine_ids=("p0",)) if mode == "concurrent" else {}
    return p, d, proxy(prefill=(p.url,), decode=(d.url,), mode=mode, **extra)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch,field,count", [
    ({"prompt": ["first prompt", "second prompt"]}, "prompt", 2),
    ({"prompt": [[1, 2, 3], [4, 5]]}, "prompt", 2),
    ({"prompt": ["a", [1, 2]]}, "prompt", 2),
    ({"prompt_embeds": ["AAAA", "BBBB", "CCCC"]}, "prompt_embeds", 3),
    ({"prompt": "text", "prompt_embeds": "AAAA"}, "prompt", 2),  # vLLM runs the embeddings and the text
], ids=["texts", "token-lists", "mixed", "embeds", "text-and-embeds"])
def test_a_batch_of_prompts_is_refused_before_any_backend(backends, proxy, mode, batch, field, count):
    """Concurrent pairing would give every prompt one transfer id; sequential prefill answers the first
    prompt's params only and holds the others' KV for nobody until its lease ends."""
    p, d, url = _proxy(backends, proxy, mode)
    status, ctype, raw = post(url + "/v1/completions", {"max_tokens": 4, **batch})
    err = json.loads(raw)["error"]
    assert status == 400 and ctype.startswith("application/json")
    assert (err["type"], err["code"], err["param"]) == ("invalid_request", 400, field)
    assert f"{count} prompts" in err["message"] and "one prompt per request" in err["message"]
    assert p.bodies == [] and d.bodies == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prompt", ["one prompt", [1, 2, 3], ["one prompt"], [[1, 2, 3]]],
                         ids=["text", "token-ids", "list-of-one-text", "list-of-one-token-list"])
def test_one_prompt_in_every_form_vllm_takes_is_routed(backends, proxy, mode, prompt):
    p, d, url = _proxy(backends, proxy, mode)
    status, _, raw = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 4, "n": 2})
    assert status == 200, raw
    assert wait_for(lambda: p.bodies)
    (_, pre), (_, dec) = p.bodies[0], d.bodies[0]
    assert pre["prompt"] == prompt and dec["prompt"] == prompt and dec["n"] == 2


def test_a_batch_is_refused_by_the_completions_route_only(backends, proxy):
    """Chat takes one conversation (vLLM refuses a list of them on /v1/chat/completions): a ``prompt`` key
    there is not a prompt, and the request goes through."""
    p, d, url = _proxy(backends, proxy, "sequential")
    status, _, _ = post(url + "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "x"}], "prompt": ["a", "b"]})
    assert status == 200 and len(p.bodies) == len(d.bodies) == 1
