"""The scheduler: which sequences run in the next step, and how many tokens each computes.

Policy, in the order `schedule()` applies it:
1. Running sequences first, in rank order: their request's priority (lower first, as
   vLLM's), then the order they started running. Each gets the rest of its uncomputed
   tokens (1 for a decode, a chunk for a prefill) within the step's token budget; the
   budget keeps one token for every running decode, and while decodes run, prompt tokens
   (chunks and new prompts alike) stay within the step budget's prefill cap
   (engine/step_budget.py), so a long prompt never stalls the streams. When the pool
   cannot hold its new tokens, a prefill chunk shrinks to what fits; if nothing fits, the
   last-ranked running sequence is preempted (its pages freed, its KV recomputed later)
   until it does. The first-ranked sequence is never preempted for another, so some
   sequence always progresses: no deadlock.
2. Then waiting sequences, in order of priority, then first come first served, while
   budget, sequence slots and pages last. A newly admitted sequence first takes what the
   prefix cache has of its prompt. A waiting sequence short of a slot or of pages
   displaces running ones of a strictly worse priority (last-ranked first; pages only
   when theirs would be enough), as vLLM's priority policy preempts; equal priorities
   never displace each other, so with none given nothing changes, and a prefill-only
   sequence is never displaced (its KV may be on its way to a decode node, layer by
   layer). A decode node's reservation for arriving KV does the same (`make_room`).
Before both, a decode node's started sequences (their prompt's KV received, `add_started`)
take the free sequence slots, in order of priority, then of starting; one of a strictly
better priority than the last-ranked running sequence displaces it. They hold their
pages while they wait, so `max_num_seqs` bounds the decode batch as it does a prefill's.
A sequence that cannot fit in the whole pool even alone finishes with "length". One that
grows past LongRoPE's original context is computed again from its start, by the long
factors (`_recompute_long`).
Invariants: every scheduled sequence holds pages for all positions it computes this step;
the tokens scheduled in one step never exceed `max_num_batched_tokens`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.arith import ceil_div

from .page_pool import PagePool
from .prefix_cache import PrefixCache, extend_page_keys
from .sequence import Sequence, Status
from .step_budget import StepBudget, StepLoad

# A chunk of a prompt whose logprobs are asked for gives logits at every position (a row of
# vocabulary size each): a bounded chunk bounds that memory.
SCORED_CHUNK_TOKENS = 512


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Sequences that can never fit in the pool; the engine finishes them with "length".
    too_long: list[Sequence] = field(default_factory=list)
    num_decodes: int = 0  # sequences computing their last token (what the step budget models)
    num_prefill_tokens: int = 0

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, pool: PagePool, cache: PrefixCache, max_num_batched_tokens: int, max_num_seqs: int,
                 step_budget: StepBudget | None = None, long_rope_from: int = 0):
        self.step_budget = step_budget or StepBudget(0)
        self.long_rope_from = long_rope_from  # LongRoPE's original context (engine/model/rope.py), 0: none
        self.pool = pool
        self.cache = cache
        self.page_size = pool.page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.started: deque[Sequence] = deque()  # KV received, waiting for a sequence slot
        self.num_preemptions = 0
        self.load = StepLoad()  # replaced whole by each schedule(): any thread may read it

    def add(self, seq: Sequence) -> None:
        """Queue seq behind every waiting sequence of its priority or a lower one."""
        seq.status = Status.WAITING
        _rank(self.waiting, seq)

    def add_started(self, seq: Sequence) -> None:
        """A sequence that already holds pages with computed KV (start_generation): it runs
        from the next step that has a sequence slot for it."""
        seq.status = Status.WAITING
        _rank(self.started, seq)

    def _admit_started(self) -> None:
        while self.started:
            priority = self.started[0].request.priority
            if len(self.running) >= self.max_num_seqs:
                if not self._displaceable(priority):
                    return
                self.preempt(self.running.pop())
            seq = self.started.popleft()
            seq.status = Status.RUNNING
            self._run(seq)

    def _run(self, seq: Sequence) -> None:
        """Rank seq among the running."""
        _rank(self.running, seq)

    def make_room(self, pages: int, priority: int) -> None:
        """Free `pages` for a request of `priority` by preempting running sequences of a
        worse one, last-ranked first, if theirs are enough; otherwise change nothing."""
        free = self.pool.num_free_pages()
        if pages > free and pages <= free + self._worse_pages(priority):
            while self.pool.num_free_pages() < pages and self._displaceable(priority):
                self.preempt(self.running.pop())

    def _displaceable(self, priority: int) -> bool:
        """Whether the last-ranked running sequence may give way to one of `priority`."""
        last = self.running[-1] if self.running else None
        return last is not None and last.request.priority > priority and not last.request.prefill_only

    def _worse_pages(self, priority: int) -> int:
        """Pages held by the running sequences that may give way to one of `priority`
        (shared ones counted too)."""
        return sum(len(s.pages) for s in self.running if s.request.priority > priority and not s.request.prefill_only)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.started)

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.started)

    def schedule(self) -> ScheduledBatch:
        if self.long_rope_from:
            for seq in [s for s in self.running if not s.long_rope and s.num_tokens > self.long_rope_from]:
                self._recompute_long(seq)
        self._admit_started()
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        decodes_left = sum(1 for s in self.running if _decoding(s))
        prompts = self.waiting or decodes_left < len(self.running)
        cap = self.step_budget.prefill_cap(decodes_left) if prompts else None
        self.load = self.step_budget.load(decodes_left, self._prompt_backlog() if prompts else 0)
        prefill_left = budget if cap is None else cap
        i = 0
        ps = self.page_size
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            decoding = _decoding(seq)
            if decoding:
                decodes_left -= 1
                num_new = 1
            else:  # a prompt chunk: within the cap, and leaving a token per decode after it
                num_new = min(_uncomputed(seq), budget - decodes_left, prefill_left)
                if num_new <= 0:
                    i += 1  # it waits a step; it keeps its pages
                    continue
            # Most steps a decode's page has room: no pool call (this loop runs per sequence).
            if seq.num_computed + num_new > len(seq.pages) * ps:
                num_new = self._fit_running(seq, num_new, i, batch)
            if num_new == 0:
                break  # seq itself was preempted or is too long; it was the last one
            self._add(batch, seq, num_new, decoding)
            budget -= num_new
            if not decoding:
                prefill_left -= num_new
            i += 1

        while self.waiting and min(budget, prefill_left) > 0:
            seq = self.waiting[0]
            priority = seq.request.priority
            if len(self.running) >= self.max_num_seqs:
                if not self._displaceable(priority):
                    break
                budget, prefill_left = self._displace(batch, budget, prefill_left)
                continue
            if not seq.pages:
                self._match_prefix(seq)
            num_new = min(_uncomputed(seq), budget, prefill_left)
            need, free = self._pages_needed(seq, num_new), self.pool.num_free_pages()
            if need > free:
                if self._displaceable(priority) and need <= free + self._worse_pages(priority):
                    budget, prefill_left = self._displace(batch, budget, prefill_left)
                    continue
                if not self.running and not batch.seqs and self._never_fits(seq, num_new):
                    self.waiting.popleft()
                    self.free(seq)
                    batch.too_long.append(seq)
                    continue
                self.free(seq)  # give matched pages back; try again next step
                break
            self.waiting.popleft()
            self._grow(seq, num_new)
            seq.status = Status.RUNNING
            self._run(seq)
            self._add(batch, seq, num_new, _decoding(seq))
            budget -= num_new
            prefill_left -= num_new
        return batch

    def _prompt_backlog(self) -> int:
        """Prompt tokens still to compute here, before this step."""
        return sum(s.num_tokens - s.num_computed for s in self.running if not _decoding(s)) + \
            sum(s.num_tokens - s.num_computed for s in self.waiting)

    def _displace(self, batch: ScheduledBatch, budget: int, prefill_left: int) -> tuple[int, int]:
        """Preempt the last-ranked running sequence, taking it out of this step's batch if
        it was in it: the budget and prefill cap it took, given back."""
        victim = self.running.pop()
        if victim in batch.seqs:
            i = batch.seqs.index(victim)
            del batch.seqs[i]
            num_new = batch.num_new_tokens.pop(i)
            budget += num_new
            if _decoding(victim):
                batch.num_decodes -= 1
            else:
                batch.num_prefill_tokens -= num_new
                prefill_left += num_new
        self.preempt(victim)
        return budget, prefill_left

    @staticmethod
    def _add(batch: ScheduledBatch, seq: Sequence, num_new: int, decoding: bool) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        if decoding:
            batch.num_decodes += 1
        else:
            batch.num_prefill_tokens += num_new

    def _fit_running(self, seq: Sequence, num_new: int, index: int, batch: ScheduledBatch) -> int:
        """Pages for `num_new` tokens of running[index], shrinking a prefill chunk or
        preempting newer sequences as needed; 0 if seq itself had to go."""
        while True:
            free = self.pool.num_free_pages()
            if self._pages_needed(seq, num_new) <= free:
                self._grow(seq, num_new)
                return num_new
            fitting = (len(seq.pages) + free) * self.page_size - seq.num_computed
            if fitting >= 1 and num_new > 1:
                num_new = min(num_new, fitting)
                continue
            # A started sequence waiting for a slot gives its pages before the running
            # sequence that needs them gives up its own.
            victim = self.started.pop() if self.running[-1] is seq and self.started else self.running.pop()
            if victim is seq and index == 0 and self._never_fits(seq, num_new):
                self.free(victim)
                batch.too_long.append(victim)  # the engine finishes it with "length"
                return 0
            self.preempt(victim)
            if victim is seq:
                return 0

    def _never_fits(self, seq: Sequence, num_new: int) -> bool:
        end = seq.num_computed + num_new
        return ceil_div(end, self.page_size) > self.pool.num_total_pages()

    def _pages_needed(self, seq: Sequence, num_new: int) -> int:
        end = seq.num_computed + num_new
        return max(0, ceil_div(end, self.page_size) - len(seq.pages))

    def _grow(self, seq: Sequence, num_new: int) -> None:
        need = self._pages_needed(seq, num_new)
        if need:
            seq.pages.extend(self.pool.allocate(need))

    def _match_prefix(self, seq: Sequence) -> None:
        # At least one token is always computed: its logits give the next token. A prompt
        # whose logprobs are asked for needs the logits of every position: nothing cached.
        max_pages = 0 if seq.request.scores_prompt else (seq.num_tokens - 1) // self.page_size
        extend_page_keys(seq.page_keys, seq.token_ids, self.page_size, max_pages, seq.cache_salt)
        seq.pages = self.cache.match(seq.page_keys[:max_pages])
        seq.num_computed = len(seq.pages) * self.page_size
        seq.num_published = len(seq.pages)
        if seq.request.num_cached_tokens == 0 and seq.index == 0:
            seq.request.num_cached_tokens = seq.num_computed

    def preempt(self, seq: Sequence) -> None:
        """Free seq's pages and queue it to recompute its KV first among the waiting of its
        priority (behind those of a better one)."""
        self.num_preemptions += 1
        self._requeue(seq)

    def _recompute_long(self, seq: Sequence) -> None:
        """A running sequence grown past LongRoPE's original context is computed again from
        its first position, every one by the long factors, as transformers' generate does
        then (engine/model/rope.py); its pages so far stay cached for the short ones."""
        self.running.remove(seq)
        seq.long_rope, seq.page_keys = True, []
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        self.free(seq)
        seq.status = Status.WAITING
        place, priority = 0, seq.request.priority
        while place < len(self.waiting) and self.waiting[place].request.priority < priority:
            place += 1
        self.waiting.insert(place, seq)

    def free(self, seq: Sequence) -> None:
        """Give back seq's pages (full cached ones stay findable) and forget its KV: the one
        place a sequence's pages are freed, whether preempted, finished or aborted."""
        self.pool.release_all(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.num_published = 0

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the queues (finished or aborted); its pages stay with it."""
        for queue in (self.running, self.waiting, self.started):
            if seq in queue:
                queue.remove(seq)
                return


def _rank(line: list[Sequence] | deque[Sequence], seq: Sequence) -> None:
    """Put seq in `line` behind every sequence of its priority or a lower one."""
    place, priority = len(line), seq.request.priority
    while place and line[place - 1].request.priority > priority:
        place -= 1
    line.insert(place, seq)


def _decoding(seq: Sequence) -> bool:
    """Computes its last token to sample the next: a stream whose gaps the step budget
    keeps (a prefill-only request's last prompt token is a prompt token)."""
    return seq.num_tokens - seq.num_computed == 1 and not seq.request.prefill_only


def _uncomputed(seq: Sequence) -> int:
    """The most tokens `seq` may compute in one step."""
    left = seq.num_tokens - seq.num_computed
    return min(left, SCORED_CHUNK_TOKENS) if seq.request.scores_prompt else left
