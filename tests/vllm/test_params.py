"""kv_transfer_params: one rule per field, parse(build(x)) == x, and malformed input named, never a crash."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlink.bootstrap import BootstrapClient, InvalidField
from kvlink.bootstrap.client import canonical_url
from kvlink.bootstrap.schema import PublishBody, checked
from kvlink.vllm.params import (
    RULES,
    BadParams,
    PrefillRequest,
    RemoteSource,
    check,
    decode_params,
    flag,
    prompt_digest,
    read,
    refusal,
)

URL = "http://127.0.0.1:7000"
SEQUENTIAL = {"do_remote_prefill": True, "remote_bootstrap_addr": URL, "remote_engine_id": "pre",
              "remote_request_id": "r1", "remote_block_ids": [0, 5, 0, 7], "remote_num_tokens": 64,
              "remote_lease_s": 30.0}

ids = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
block_lists = st.lists(st.integers(0, (1 << 62) - 1), max_size=40)
sources = st.builds(
    RemoteSource,
    bootstrap_url=st.sampled_from([URL, "https://bootstrap.example:443"]),
    engine_id=ids,
    request_id=ids,
    block_ids=block_lists.map(tuple),
    num_tokens=st.none() | st.integers(0, (1 << 40) - 1),
    transfer_id=st.none() | ids,
    lease_s=st.none() | st.floats(min_value=1e-3, max_value=86_400.0),
    prompt_sha=st.none() | st.lists(st.integers(0, 1000), max_size=50).map(prompt_digest),
)
concurrent_sources = st.builds(RemoteSource, bootstrap_url=st.just(URL), engine_id=st.none() | ids, transfer_id=ids)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=20,
)


# ----- build then parse -------------------------------------------------------------------------------------


@given(sources | concurrent_sources)
def test_what_is_built_parses_back_to_the_same_source(src):
    params = src.to_params()
    assert params["do_remote_prefill"] is True
    assert all(v is not None for v in params.values())  # absent, never null
    assert RemoteSource.from_params(params) == src
    assert decode_params(params) == params  # the router hands decode exactly what prefill built


@given(sources)
def test_a_prefill_answer_accepted_here_is_accepted_by_the_bootstrap_server(src):
    """The fields prefill publishes share the bootstrap's bounds: nothing parses here and fails there."""
    checked(PublishBody, engine_id=src.engine_id, request_id=src.request_id, transfer_id=src.transfer_id,
            block_ids=[list(g) for g in src.block_ids], num_tokens=src.num_tokens or 0, lease_s=src.lease_s,
            prompt_sha=src.prompt_sha)


@given(st.none() | ids)
def test_prefill_request_round_trip(transfer_id):
    params = PrefillRequest(transfer_id).to_params()
    assert flag(params, "do_remote_decode")
    assert PrefillRequest.from_params(params) == PrefillRequest(transfer_id)


def test_refusal_makes_decode_compute_locally():
    answer = refusal("publish failed: x")
    assert answer == {"do_remote_prefill": False, "kvlink_error": "publish failed: x"}
    assert decode_params(answer) == {"do_remote_prefill": False}
    assert len(refusal("x" * 10_000)["kvlink_error"]) == 4096
    read(refusal("x" * 10_000), "kvlink_error")  # what we build obeys our own rule


# ----- what vLLM and proxies send today ---------------------------------------------------------------------


def test_block_ids_flat_or_one_group_and_the_null_block_allowed():
    flat = RemoteSource.from_params(SEQUENTIAL)
    nested = RemoteSource.from_params(SEQUENTIAL | {"remote_block_ids": [[0, 5, 0, 7]]})
    assert flat.block_ids == nested.block_ids == ((0, 5, 0, 7),)  # 0: vLLM's null block, kept by position
    assert RemoteSource.from_params(SEQUENTIAL | {"remote_block_ids": []}).block_ids == ((),)
    assert RemoteSource.from_params(SEQUENTIAL | {"remote_block_ids": [[]]}).block_ids == ((),)
    assert flat.to_params()["remote_block_ids"] == [0, 5, 0, 7]  # one group travels flat, as vLLM sends it


def test_several_kv_cache_groups_travel_as_one_list_each():
    src = RemoteSource.from_params(SEQUENTIAL | {"remote_block_ids": [[1, 2], [0, 4]]})
    assert src.block_ids == ((1, 2), (0, 4))
    assert src.to_params()["remote_block_ids"] == [[1, 2], [0, 4]]
    assert RemoteSource(**{**vars(src)}).block_ids == ((1, 2), (0, 4))  # the checked form checks again
    with pytest.raises(BadParams, match="remote_block_ids") as e:
        RemoteSource.from_params(SEQUENTIAL | {"remote_block_ids": [[1, 2], [3, "x"]]})
    assert e.value.field == "remote_block_ids"


def test_bootstrap_addr_without_scheme_gets_http():
    src = RemoteSource.from_params({"remote_bootstrap_addr": "127.0.0.1:5", "transfer_id": "t"})
    assert src.bootstrap_url == "http://127.0.0.1:5" and src.block_ids is None and src.key == "t"
    assert src.to_params()["remote_bootstrap_addr"] == "http://127.0.0.1:5"


def test_the_bootstrap_addr_rule_is_the_bootstrap_clients():
    """What decode will hand to BootstrapClient is checked by the client's own rule, in its canonical form."""
    with pytest.raises(ValueError, match="port 0"):
        canonical_url("http://h:0")
    for url in ("http://h:1/", "h:1", "HTTPS://h", "[::1]:7", "http://a:1/kv", "ftp://a", "u@h:1", "h:0"):
        try:
            canonical = canonical_url(url)
        except ValueError:
            with pytest.raises(BadParams) as e:
                RemoteSource(bootstrap_url=url, transfer_id="t")
            assert e.value.field == "remote_bootstrap_addr"
            with pytest.raises(InvalidField):
                BootstrapClient(url)
        else:
            assert RemoteSource(bootstrap_url=url, transfer_id="t").bootstrap_url == canonical
            assert BootstrapClient(canonical).url == canonical


@pytest.mark.parametrize("kw,field", [
    ({"bootstrap_url": URL, "engine_id": "e" * 257, "transfer_id": "t"}, "remote_engine_id"),
    ({"bootstrap_url": "not a url", "transfer_id": "t"}, "remote_bootstrap_addr"),
    ({"bootstrap_url": URL, "transfer_id": ""}, "transfer_id"),
    ({"bootstrap_url": URL, "transfer_id": "t", "lease_s": 0.0}, "remote_lease_s"),
    ({"bootstrap_url": URL, "engine_id": "e", "request_id": "r", "block_ids": (1, -1)}, "remote_block_ids"),
    ({"bootstrap_url": None, "transfer_id": "t"}, "remote_bootstrap_addr"),
    ({"bootstrap_url": URL, "engine_id": "e", "request_id": "r"}, "remote_block_ids"),
])
def test_a_source_built_directly_obeys_the_same_rules(kw, field):
    """The router builds a RemoteSource itself (concurrent pairing): a value decode would refuse fails here."""
    with pytest.raises(BadParams) as e:
        RemoteSource(**kw)
    assert e.value.field == field


def test_a_source_built_directly_is_kept_in_its_checked_form():
    src = RemoteSource(bootstrap_url="127.0.0.1:5/", engine_id="e", request_id="r", block_ids=(0, 3))
    assert src.bootstrap_url == "http://127.0.0.1:5" and src.block_ids == ((0, 3),)
    assert src == RemoteSource.from_params(src.to_params())


def test_transfer_id_has_one_rule_on_both_sides():
    """It used to be 256 characters on prefill and 512 on decode: a transfer id prefill accepted could be
    refused by decode, or the other way round."""
    for n, ok in ((1, True), (300, True), (512, True), (513, False), (0, False)):
        tid = "t" * n
        for parse in (lambda: PrefillRequest.from_params({"do_remote_decode": True, "transfer_id": tid}),
                      lambda: RemoteSource.from_params({"remote_bootstrap_addr": URL, "transfer_id": tid})):
            if ok:
                assert parse().transfer_id == tid
            else:
                with pytest.raises(BadParams, match="'transfer_id'") as e:
                    parse()
                assert e.value.field == "transfer_id"


# ----- malformed params name the field ----------------------------------------------------------------------

BAD_VALUES = {
    "do_remote_prefill": ["yes", 1, [True]],
    "remote_bootstrap_addr": [12, "", "http://a b", "h" * 513, ["http://a"], "ftp://a", "http://a:1/kv", "a:x",
                              "h\x00:1", "h\x7f:1"],
    "remote_engine_id": [5, "", "e" * 257, {"id": "e"}],
    "remote_request_id": [5, "", "r" * 513],
    "remote_block_ids": ["not-a-list", [-1], [1, True], [1.0], [1 << 62], [[1], 2], [1, [2]], [[1], [2, "x"]]],
    "remote_num_tokens": [-1, True, 1.5, "64", 1 << 40],
    "remote_lease_s": [0, -1.0, True, "30", float("nan"), float("inf"), 86_401.0],
    "transfer_id": [5, "", "t" * 513],
    "remote_prompt_sha": [5, "", "A" * 32, "0" * 31, "0" * 33, "g" * 32, ["0" * 32]],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in BAD_VALUES.items() for v in vs])
def test_each_malformed_field_is_named(field, value):
    with pytest.raises(BadParams) as e:
        decode_params(SEQUENTIAL | {field: value})
    assert e.value.field == field and repr(field) in str(e.value)


@pytest.mark.parametrize("missing", ["remote_engine_id", "remote_request_id", "remote_block_ids"])
def test_sequential_params_missing_a_field_name_it(missing):
    params = {k: v for k, v in SEQUENTIAL.items() if k != missing}
    with pytest.raises(BadParams, match=f"missing {missing}") as e:
        RemoteSource.from_params(params)
    assert e.value.field == missing
    if missing == "remote_block_ids":
        RemoteSource.from_params(params | {"transfer_id": "t"})  # concurrent pairing needs none of them
    else:  # block ids name one prefill request's blocks: never without its engine and id (nothing renews them,
        # and a renewal naming no request fails for every pull renewed with it)
        with pytest.raises(BadParams, match=f"missing {missing}"):
            RemoteSource.from_params(params | {"transfer_id": "t"})


def test_bootstrap_addr_is_required():
    with pytest.raises(BadParams, match="remote_bootstrap_addr.*required") as e:
        RemoteSource.from_params({"transfer_id": "t"})
    assert e.value.field == "remote_bootstrap_addr"


def test_not_an_object():
    for bad in (None, [], "x", 5):
        with pytest.raises(BadParams, match="JSON object"):
            RemoteSource.from_params(bad)
        with pytest.raises(BadParams, match="JSON object"):
            decode_params(bad)


def test_absent_and_null_are_the_same_and_unknown_keys_are_ignored():
    assert RemoteSource.from_params(SEQUENTIAL | {"transfer_id": None, "remote_host": "x", "tp_size": 2}) == \
        RemoteSource.from_params(SEQUENTIAL)
    assert not flag({}, "do_remote_decode") and not flag({"do_remote_decode": None}, "do_remote_decode")


@given(st.dictionaries(st.sampled_from(sorted(RULES)) | st.text(max_size=8), json_values, max_size=10))
def test_fuzz_parse_returns_a_source_or_names_a_field(params):
    for parse in (RemoteSource.from_params, PrefillRequest.from_params, decode_params):
        try:
            parse(params)
        except BadParams as e:
            assert e.field is None or (e.field in RULES and e.field in str(e))
            assert len(str(e)) < 600  # a hostile value is quoted short


@given(st.sampled_from(sorted(BAD_VALUES)), json_values)
def test_fuzz_one_field_replaced_by_anything(field, value):
    params = SEQUENTIAL | {field: value}
    try:
        src = RemoteSource.from_params(params)
    except BadParams as e:
        assert e.field == field
    else:
        assert RemoteSource.from_params(src.to_params()) == src


def test_the_proxy_can_import_params_without_vllm():
    code = "import sys, kvlink.vllm.params, kvlink.proxy.router; assert 'vllm' not in sys.modules, 'vllm'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_prompt_digest_is_of_the_token_ids_in_order():
    assert prompt_digest(None) is None
    d = prompt_digest([1, 2, 3])
    assert len(d) == 32 and int(d, 16) >= 0 and d == prompt_digest((1, 2, 3))
    assert len({d, prompt_digest([1, 3, 2]), prompt_digest([1, 2]), prompt_digest([1, 2, 3, 0]),
                prompt_digest([1, 2, 3 + (1 << 32)])}) == 5
    assert prompt_digest([]) == "e3b0c44298fc1c149afbf4c8996fb924"  # sha256 of no bytes
    assert prompt_digest([1]) == hashlib.sha256((1).to_bytes(8, "little")).hexdigest()[:32]  # int64 LE, any host


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("value", ["\udcff", ["\udcff"], [["\udcff"]], "http://\udcff:1"])
def test_a_lone_surrogate_anywhere_is_bad_params_naming_the_field(name, value):
    """A client's JSON may escape a lone UTF-16 surrogate; msgspec then raises UnicodeEncodeError where it
    expects a number or a list, which escaped the scheduler's BadParams handling into vLLM's loop (an
    engine core in process died), and strings holding one were accepted although no server can take them."""
    with pytest.raises(BadParams) as err:
        check(name, value)
    assert err.value.field == name
