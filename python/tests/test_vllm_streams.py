"""KvxferPushConnector's per-step page bookkeeping for layer-by-layer streaming
(kvxfer.vllm_streams), without vLLM."""

from kvxfer.vllm_streams import StepPages, Stop, StreamPlan

BLOCK = 32


def plan(prompt: int = 257) -> StreamPlan:
    p = StreamPlan(BLOCK)
    p.track("r", 7, prompt)
    return p


def test_each_step_hands_the_pages_whose_last_token_it_computes() -> None:
    p = plan()
    blocks = list(range(100, 109))  # 9 pages for 257 tokens
    got = [p.step("r", blocks, 0, 64, fresh=True)]
    for computed in (64, 128, 192, 256):
        got.append(p.step("r", None, computed, min(64, 257 - computed), fresh=False))
    assert got == [
        StepPages("r", 7, [100, 101], 9),
        StepPages("r", 7, [102, 103], 9),
        StepPages("r", 7, [104, 105], 9),
        StepPages("r", 7, [106, 107], 9),
        StepPages("r", 7, [108], 9),  # the prompt's last, partial page
    ]
    assert p.finished("r", handed_off=True) == (True, None)
    assert not p


def test_a_step_that_completes_no_page_hands_none_and_new_blocks_join_the_list() -> None:
    p = plan(70)
    assert p.step("r", [5], 0, 20, fresh=True) is None
    assert p.step("r", [6], 20, 20, fresh=False) == StepPages("r", 7, [5], 3)
    assert p.step("r", [9], 40, 30, fresh=False) == StepPages("r", 7, [6, 9], 3)


def test_a_request_preempted_after_pages_went_out_is_cut_and_hands_nothing_off() -> None:
    p = plan()
    assert p.step("r", [1, 2, 3], 0, 64, fresh=True) == StepPages("r", 7, [1, 2], 9)
    # Scheduled again from the start with new blocks: its room ends, it runs on.
    assert p.step("r", [4, 5, 6], 0, 64, fresh=True) == Stop("r", 7, ended=False)
    assert p.step("r", None, 64, 64, fresh=False) is None, "no longer streams"
    assert p.finished("r", handed_off=True) == (False, None)
    assert p.finished("r", handed_off=True) == (True, None), "forgotten once ended"


def test_a_request_preempted_before_any_page_went_out_streams_its_new_blocks() -> None:
    p = plan(100)
    assert p.step("r", [1], 0, 20, fresh=True) is None
    assert p.step("r", [4, 5, 6, 7], 0, 100, fresh=True) == StepPages("r", 7, [4, 5, 6, 7], 4)


def test_a_request_ending_without_handing_off_stops_its_room_once_pages_are_out() -> None:
    p = plan()
    p.step("r", [1, 2, 3], 0, 64, fresh=True)
    assert p.finished("r", handed_off=False) == (False, Stop("r", 7, ended=True))
    q = plan()
    q.step("r", [1], 0, 20, fresh=True)  # nothing out yet
    assert q.finished("r", handed_off=False) == (True, None)


def test_untracked_requests_and_tracking_twice() -> None:
    p = plan()
    assert p.step("other", [1], 0, 64, fresh=True) is None
    assert p.finished("other", handed_off=True) == (True, None)
    p.step("r", [1, 2, 3], 0, 64, fresh=True)
    p.track("r", 7, 257)  # again (vLLM calls after every allocation): progress kept
    assert p.step("r", None, 64, 32, fresh=False) == StepPages("r", 7, [3], 9)
