"""Which prompt pages of each prefill request go out in each engine step, for
KvxferPushConnector's layer-by-layer streaming: the scheduler-side bookkeeping, free of vLLM
(so that it is tested without an engine).

A page goes out in the step that computes its last token (or the prompt's last). A request
preempted after some of its pages went out is *cut*: those pages cannot be taken back, so
its room is aborted and it hands nothing off when it ends. A request that ends otherwise
than handing off while pages are out has its room aborted too, its blocks kept until the
room stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def pages_for(tokens: int, block_size: int) -> int:
    """Blocks holding `tokens` tokens."""
    return -(-tokens // block_size)


@dataclass
class StepPages:
    """The prompt pages a prefill request completes in this step (in prompt order, after
    those of earlier steps), of its `total`, for streaming them layer by layer."""

    req: str
    room: int
    pages: list[int]
    total: int


@dataclass
class _Tracked:
    room: int
    prompt: int
    blocks: list[int] = field(default_factory=list)
    handed: int = 0  # pages handed to the workers


@dataclass
class Stop:
    """A room to abort: `ended` if its request ended (its blocks wait for the room to stop),
    not if it was preempted and runs on."""

    req: str
    room: int
    ended: bool


class StreamPlan:
    """The prefill requests that stream, and how far each got."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._reqs: dict[str, _Tracked] = {}
        self._cut: set[str] = set()

    def track(self, req: str, room: int, prompt_tokens: int) -> None:
        """Streams `req` (once: a request scheduled again keeps its progress)."""
        self._reqs.setdefault(req, _Tracked(room, prompt_tokens))

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def step(
        self, req: str, new_blocks: list[int] | None, computed: int, scheduled: int, fresh: bool
    ) -> StepPages | Stop | None:
        """`req` was scheduled for `scheduled` tokens after `computed`, with `new_blocks`
        (all its blocks when `fresh`: first scheduled, or resumed after a preemption)."""
        t = self._reqs.get(req)
        if t is None:
            return None
        if fresh and t.handed:
            del self._reqs[req]
            self._cut.add(req)
            return Stop(req, t.room, ended=False)
        t.blocks = (t.blocks if not fresh else []) + (new_blocks or [])
        end = computed + scheduled
        total = pages_for(t.prompt, self._block_size)
        done = total if end >= t.prompt else end // self._block_size
        if done <= t.handed:
            return None
        pages = t.blocks[t.handed : done]
        t.handed = done
        return StepPages(req, t.room, pages, total)

    def finished(self, req: str, handed_off: bool) -> tuple[bool, Stop | None]:
        """`req` ended. Returns whether it may hand off (False once cut), and the room to
        abort when it ended otherwise than handing off with pages already out."""
        if req in self._cut:
            self._cut.discard(req)
            return False, None
        t = self._reqs.pop(req, None)
        if t is not None and t.handed and not handed_off:
            return False, Stop(req, t.room, ended=True)
        return True, None
