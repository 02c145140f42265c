"""Decode requests sharing one prefill request (n > 1 samples of a prompt): kvlink.vllm.siblings, pure."""

from __future__ import annotations

from kvlink.vllm.siblings import Siblings


def test_the_first_pulls_the_others_wait_and_prefill_hears_once_all_are_done():
    s = Siblings()
    assert not s.should_wait("k", "0_r")
    s.started("k", "0_r")
    assert s.should_wait("k", "1_r") and s.should_wait("k", "2_r")
    assert not s.should_wait("k", "0_r")  # the puller itself never waits
    assert s.ended("k", "0_r", pulled=True) is None  # two siblings still need prefill's copy
    assert s.waiting("k") == {"1_r", "2_r"}
    assert not s.should_wait("k", "1_r")  # nobody pulls now: it pulls what its prefix cache lacks
    s.started("k", "1_r")
    assert s.should_wait("k", "2_r")
    assert s.ended("k", "1_r", pulled=True) is None
    s.started("k", "2_r")
    assert s.ended("k", "2_r", pulled=True) is True  # the last one: "pulled"
    assert len(s) == 0


def test_a_sibling_aborted_while_waiting_does_not_release_under_the_others():
    s = Siblings()
    s.started("k", "a")
    assert s.should_wait("k", "b")
    assert s.ended("k", "b", pulled=False) is None  # aborted while waiting: "a" still pulls
    assert s.ended("k", "a", pulled=False) is False  # the pull failed and nobody else wants it: abandoned


def test_a_failed_first_pull_leaves_the_waiting_sibling_to_pull_everything():
    s = Siblings()
    s.started("k", "a")
    assert s.should_wait("k", "b")
    assert s.ended("k", "a", pulled=False) is None
    assert not s.should_wait("k", "b")
    s.started("k", "b")
    assert s.ended("k", "b", pulled=True) is True  # one of them pulled: "pulled"


def test_unrelated_prompts_and_single_requests_are_untouched():
    s = Siblings()
    s.started("k1", "a")
    assert not s.should_wait("k2", "b")
    assert s.ended("k3", "c", pulled=False) is False  # never seen (aborted before asking): as before
    assert s.ended("k1", "a", pulled=True) is True
    assert len(s) == 0


def test_a_release_decided_before_a_late_sibling_started_is_void():
    from kvlink.vllm.siblings import is_sample

    s = Siblings()
    s.started("k", "0_r")
    assert s.ended("k", "0_r", pulled=True) is True
    starts = s.starts("k")  # the release waits a grace period for late samples
    s.started("k", "1_r")  # a late sibling arrives and pulls
    assert not s.settle("k", starts)  # the first release is void
    assert s.ended("k", "1_r", pulled=True) is True
    assert s.settle("k", s.starts("k"))  # the last one's release goes out, once
    assert is_sample("0_cmpl-abc") and is_sample("12_x") and not is_sample("cmpl-1") and not is_sample("0_")
