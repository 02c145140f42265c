"""Decode requests sharing one prefill request (n > 1 samples of a prompt): kvlink.vllm.siblings, pure."""

from __future__ import annotations

from kvlink.vllm.siblings import Siblings


def test_the_first_pulls_the_others_wait_and_prefill_hears_once_all_are_done():
    s = Siblings()
    assert s.ask("k", "0_r") == "pull"
    s.started("k", "0_r")
    assert s.ask("k", "1_r") == s.ask("k", "2_r") == "wait"
    assert s.ask("k", "0_r") == "pull"  # the puller itself never waits
    assert s.ended("k", "0_r", pulled=True) is None  # two siblings still need prefill's copy
    assert s.waiting("k") == {"1_r", "2_r"}
    assert s.ask("k", "1_r") == "pull"  # nobody pulls now: it pulls what its prefix cache lacks
    s.started("k", "1_r")
    assert s.ask("k", "2_r") == "wait"
    assert s.ended("k", "1_r", pulled=True) is None
    s.started("k", "2_r")
    assert s.ended("k", "2_r", pulled=True) is True  # the last one: "pulled"
    assert len(s) == 0


def test_a_sibling_aborted_while_waiting_does_not_release_under_the_others():
    s = Siblings()
    s.started("k", "a")
    assert s.ask("k", "b") == "wait"
    assert s.ended("k", "b", pulled=False) is None  # aborted while waiting: "a" still pulls
    assert s.ended("k", "a", pulled=False) is False  # the pull failed and nobody else wants it: abandoned


def test_a_failed_first_pull_leaves_the_waiting_sibling_to_pull_everything():
    s = Siblings()
    s.started("k", "a")
    assert s.ask("k", "b") == "wait"
    assert s.ended("k", "a", pulled=False) is None
    assert s.ask("k", "b") == "pull"
    s.started("k", "b")
    assert s.ended("k", "b", pulled=True) is True  # one of them pulled: "pulled"


def test_unrelated_prompts_and_single_requests_are_untouched():
    s = Siblings()
    s.started("k1", "a")
    assert s.ask("k2", "b") == "pull"
    assert s.ended("k3", "c", pulled=False) is False  # never seen (aborted before asking): as before
    assert s.ended("k1", "a", pulled=True) is True
    assert s.ended("k2", "b", pulled=True) is True
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


def test_a_sibling_offered_the_kv_holds_the_release_until_it_starts_or_leaves():
    """Offered (asked, told to pull) but not started yet when the grace ends: the release waits for it, and
    is decided by whichever sibling is last."""
    s = Siblings()
    s.started("k", "0_r")
    assert s.ended("k", "0_r", pulled=True) is True
    starts = s.starts("k")
    assert s.ask("k", "1_r") == "pull"
    assert not s.settle("k", starts)  # 1_r was offered the KV: not released under it
    s.started("k", "1_r")
    assert s.ended("k", "1_r", pulled=True) is True
    assert s.settle("k", s.starts("k"))
    s2 = Siblings()
    assert s2.ask("k", "0_r") == "pull"
    assert s2.ended("k", "0_r", pulled=False) is False  # offered, then computed locally or aborted: gone
    assert s2.settle("k", s2.starts("k"))


def test_a_sibling_asking_after_the_release_was_decided_computes_the_prompt():
    """Its renewal could reach the server before the release and be answered "held", so a READ it then
    makes could be trusted after prefill freed the blocks: it is told "gone" instead."""
    s = Siblings()
    s.started("k", "0_r")
    assert s.ended("k", "0_r", pulled=True) is True
    assert s.settle("k", s.starts("k"))
    assert s.ask("k", "1_r") == "gone"
    assert s.ask("k2", "0_x") == "pull"  # another prompt is not affected
