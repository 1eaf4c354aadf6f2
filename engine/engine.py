"""The step-driven engine: requests in, one scheduler iteration per `step()`, deltas out.

Single-threaded: entry points assert that they run on the owner thread (`AsyncEngine`'s in
servers; engine/owner_thread.py). Ways a request enters, each with its checks in one place:
- `add_request`: an ordinary request, prefilled and decoded here.
- `add_request(prefill_only=True)` (prefill node): computes the prompt's KV, never samples,
  finishes with "prefilled" and keeps its pages pinned until `release`; that output names
  each position's slot (`slots`) and, on a GPU, the event to wait for before reading them.
  `full_prompt_len`: the whole prompt's, where it computes the start (LongRoPE's follows it).
- `prepare_receive` then `start_generation` (decode node): reserve slots for KV computed
  elsewhere, park the request, then generate once the KV has arrived.
Invariants: `abort` and `release` return every page a request holds; an idle engine has
`num_free_pages() == num_total_pages()`.

KV cache layout: `kv_cache` is one dense tensor, allocated once and registered whole with
NIXL by the roles, indexed `[num_pages, num_layers, 2 (K, V), page_size, Hkv, D]` in either
memory order (`--kv-layout`, engine/kv_pool.py says why each). Slot `s` is offset `s % page_size`
of page `s // page_size`. Layer i's K and V are the views `kv_cache[:, i, 0]` / `kv_cache[:, i, 1]`,
`[num_pages, page_size, Hkv, D]`, the attention ops' form. Tensor-parallel (engine/tp): a pool per rank.
"""

from __future__ import annotations

import time

import torch

from pdserve.arith import ceil_div

from .bans import BanRules
from .capacity import KVCapacity
from .completion import append_text, append_token, append_token_id, eos_token_ids, take_delta
from .config import EngineConfig, SamplingParams
from .detokenizer import detokenizer_factory
from .device import usable_device
from .intake import new_request
from .kv_pool import kv_pool
from .lora import load_adapters
from .memory import kv_cache_pages
from .model import ModelRunner
from .model.arch import served_context
from .model.weights import load_config, load_tokenizer
from .native import keep_step_buffers, lazy_zeros
from .outputs import RequestOutput, Reservation
from .owner_thread import SingleThreaded, entry_point
from .page_pool import OutOfPages, PagePool
from .prefix_cache import PrefixCache, extend_page_keys
from .prompt_logprobs import score_prompts
from .sampler import sample
from .scheduler import Scheduler
from .sequence import Request, Sequence, Status, step_layer_hook
from .step_budget import StepBudget
from .structured import Grammars
from .tp.group import TPGroup, TPRunner
from .tp.shard import load_rank, split_for


class UnknownRequest(ValueError):
    """A request id the engine does not hold (in the state the call needs)."""


class Engine(SingleThreaded):
    def __init__(self, config: EngineConfig):
        config.validate()
        if (device := usable_device(config.device)).type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # Triton launches on the thread's current device ("cuda" is it)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)  # never pinned: cores are shared
        if device.type == "cpu":
            keep_step_buffers()
        self.config = config
        # Ranks 1.. start first: they start, and load their shares of the weights, while this rank loads its own.
        self.tp = TPGroup(config) if config.tensor_parallel_size > 1 else None
        try:
            self._build(config, getattr(torch, config.dtype))
        except BaseException:
            self.close()  # the other ranks: starting, or waiting for their pools
            raise

    def _build(self, config: EngineConfig, dtype: torch.dtype) -> None:
        self.model_config = c = load_config(config.model_dir)
        self.max_model_len = served_context(c, config.max_model_len)  # refuses a model it cannot run
        self.vocab_size = c.vocab_size
        shards = split_for(config, c)  # refuses a split that cannot be
        if self.tp is not None:
            self.tp.assign(shards, self.max_model_len)
        self.tokenizer = load_tokenizer(config.model_dir)
        self.model = m = load_rank(config, c, dtype, self.max_model_len, shards[0])
        if self.tp is not None:
            self.tp.join()  # the pools are sized below with every rank's weights loaded
        self.adapters = load_adapters(config.lora_modules, m, c, dtype, config.device, shards[0])
        self.page_size = config.page_size
        pool_heads = sum(s.num_kv_heads for s in shards)  # the ranks share this host's memory
        bytes_per_page = m.num_layers * 2 * self.page_size * pool_heads * m.head_dim * dtype.itemsize
        self.num_pages, self.kv_cache_sizing = kv_cache_pages(config, bytes_per_page)
        self.capacity = KVCapacity(self.page_size, self.num_pages, self.max_model_len, m.long_rope_from)  # any thread reads it
        self.kv_cache = kv_pool(config.kv_layout, self.num_pages, m.num_layers, self.page_size, m.num_kv_heads,
                                m.head_dim, lambda shape: lazy_zeros(shape, dtype, config.device))
        self.pool = PagePool(self.num_pages, self.page_size)
        self.prefix_cache = PrefixCache(self.pool, config.enable_prefix_cache)
        self.step_budget = StepBudget.for_target_ms(config.decode_itl_target_ms)
        self.scheduler = Scheduler(self.pool, self.prefix_cache, config.max_num_batched_tokens, config.max_num_seqs,
                                   self.step_budget, m.long_rope_from)
        self.runner = ModelRunner(m, self.kv_cache, self.page_size, config.resolved_attention_backend, config.device,
                                  config.max_num_seqs, self.max_model_len, config.cuda_graphs)
        if self.tp is not None:  # tensor-parallel: every step goes to every rank
            self.tp.attach(self.kv_cache)
            self.runner = TPRunner(self.runner, self.tp, self.page_size)
        self.kv_pools = [self.kv_cache, *(self.tp.pools if self.tp else [])]  # every rank's
        self.kv_head_begins = [s.kv_begin for s in shards]  # the first KV head of each pool
        self.eos_token_ids = eos_token_ids(c, self.tokenizer)
        self.new_detokenizer = detokenizer_factory(self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)  # structured outputs
        self.bans = BanRules(self.tokenizer, self.eos_token_ids)  # min_tokens, bad_words
        self.requests: dict[str, Request] = {}
        self.layer_hook = None  # (layer, [(request id, begin, end, slots)]) of prefill-only requests
        self._arrivals = 0
        self.last_step_scheduled = 0  # sequences the last step ran (0: blocked or idle)
        # GPU: a step's text (detokenizing, stop strings) is done during the next step's forward,
        # which the host would only wait for. (sequence, token, is stop token) to finish.
        self.overlap_output = config.overlap_output and self.runner.on_gpu
        self._text_pending: list[tuple[Sequence, int, bool]] = []
        # GPU: a step sampling nothing may leave KV stores queued, which remote writes must follow.
        self._stores_queued = False

    # ---- accounting -------------------------------------------------------------------
    @entry_point
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages()

    def num_total_pages(self) -> int:  # a constant: not an entry point to check
        return self.pool.num_total_pages()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do for one rank)."""
        if self.tp is not None:
            self.tp.close()

    @entry_point
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._text_pending)

    # ---- entering requests (`lora`: a LoRA adapter's name, "" for the base model) ------
    @entry_point
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, prefill_only: bool = False,
                    cache_salt: str = "", priority: int = 0, lora: str = "", full_prompt_len: int = 0) -> None:
        request = self._new_request(request_id, prompt_token_ids, params, prefill_only, cache_salt, lora, full_prompt_len)
        request.priority, self.requests[request_id] = priority, request
        # Samples after the first wait for its prefill, then find the prompt's full pages
        # in the prefix cache instead of computing them again.
        self.scheduler.add(request.seqs[0])

    @entry_point
    def prepare_receive(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        kv_window_end: int, cache_salt: str = "", priority: int = 0, lora: str = "") -> Reservation:
        """Reserve slots for the KV of positions [matched, kv_window_end) and park the request
        (`matched` from the prefix cache, at most end-1 tokens: one position always comes).
        Running sequences of a worse `priority` give pages if theirs suffice; else OutOfPages."""
        if not isinstance(kv_window_end, int) or not 0 <= kv_window_end < len(prompt_token_ids or []):
            raise ValueError(f"kv_window_end must be in [0, {len(prompt_token_ids or [])}), got {kv_window_end!r}")
        if params.prompt_logprobs is not None and kv_window_end > 0:  # (engine/prompt_logprobs.py)
            raise ValueError(f"prompt_logprobs needs kv_window_end 0 (the whole prompt computed here), got {kv_window_end}")
        request = self._new_request(request_id, prompt_token_ids, params, False, cache_salt, lora)
        if self._stores_queued:
            torch.cuda.current_stream(self.runner.device).synchronize()
            self._stores_queued = False
        seq = request.seqs[0]
        ps = self.page_size
        max_pages = max(0, kv_window_end - 1) // ps
        extend_page_keys(seq.page_keys, seq.token_ids, ps, max_pages, seq.cache_salt)
        seq.pages = self.prefix_cache.match(seq.page_keys[:max_pages])
        matched = len(seq.pages) * ps
        self.scheduler.make_room(need := ceil_div(kv_window_end, ps) - len(seq.pages), priority)
        try:
            seq.pages += self.pool.allocate(need)
        except OutOfPages:
            self.pool.release_all(seq.pages)
            raise
        seq.num_computed, seq.num_published, seq.status = matched, matched // ps, Status.PARKED
        request.kv_window_end, request.num_cached_tokens, request.priority = kv_window_end, matched, priority
        self.requests[request_id] = request
        return Reservation(request_id, matched, kv_window_end, seq.slots(matched, kv_window_end, ps))

    @entry_point
    def start_generation(self, request_id: str) -> None:
        """Un-park: positions [0, kv_window_end) hold received KV; compute the rest here."""
        request = self.requests.get(request_id)
        if request is None or request.seqs[0].status is not Status.PARKED:
            raise UnknownRequest(f"no parked request {request_id!r}")
        seq = request.seqs[0]
        seq.num_computed = request.kv_window_end
        self._publish(seq)
        self.scheduler.add_started(seq)

    @entry_point
    def abort(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            self.scheduler.remove(seq)
            self.scheduler.free(seq)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return True

    @entry_point
    def release(self, request_id: str) -> bool:
        """Unpin a finished prefill-only request's pages (its full pages stay cached)."""
        request = self.requests.get(request_id)
        if request is None or request.seqs[0].status is not Status.PREFILLED:
            return False
        return self.abort(request_id)

    @entry_point
    def slots_of(self, request_id: str) -> list[int]:
        """Slot of every position [0, len(prompt)) of a prefilled (prefill-only) request."""
        request = self.requests.get(request_id)
        if request is None or request.seqs[0].status is not Status.PREFILLED:
            raise UnknownRequest(f"no prefilled request {request_id!r}")
        seq = request.seqs[0]
        return seq.slots(0, seq.num_tokens, self.page_size)

    def _new_request(self, request_id, prompt_token_ids, params, prefill_only, cache_salt="", lora="", full_prompt_len=0):
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._arrivals += 1
        return new_request(request_id, prompt_token_ids, params, prefill_only, cache_salt, self.capacity, self.vocab_size,
                           self.new_detokenizer, self._arrivals, self.grammars, self.bans, self.adapters, lora, full_prompt_len)

    # ---- one step ----------------------------------------------------------------------
    @entry_point
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self.last_step_scheduled = len(batch) + len(batch.too_long)
        touched: dict[str, Request] = {}
        for seq in batch.too_long:
            self._finish(seq, "length")
            touched[seq.request.request_id] = seq.request
        outputs = []
        if batch:
            seqs, num_new = batch.seqs, batch.num_new_tokens
            now = time.perf_counter()
            for seq in seqs:
                seq.request.scheduled_at = seq.request.scheduled_at or now
            samples = [not s.request.prefill_only and s.num_computed + n == s.num_tokens for s, n in zip(seqs, num_new)]
            # A prompt's logprobs want its chunk's every row; only prompt chunks score.
            scored = [s.index == 0 and s.request.scores_prompt for s in seqs] if batch.num_prefill_tokens else []
            wants = [n if sc else int(smp) for n, sc, smp in zip(num_new, scored, samples)] if any(scored) else samples
            logits = self.runner.run(seqs, num_new, wants, step_layer_hook(self.layer_hook, seqs, num_new, self.page_size))
            if any(scored):
                logits = score_prompts(seqs, wants, scored, samples, logits)
            for seq, n in zip(seqs, num_new):
                seq.num_computed += n
                self._publish(seq)
            # While the device runs this step: the text of the last one's tokens.
            outputs = self._finish_text()
            kv_ready = None
            if self.runner.on_gpu and any(s.request.prefill_only and s.num_computed == s.num_tokens for s in seqs):
                # The kernels are asynchronous: a prefill-only request is reported done with an
                # event its KV's readers wait for, and this thread goes on to the next step.
                kv_ready = torch.cuda.Event()
                kv_ready.record(torch.cuda.current_stream(self.runner.device))
            sampling = [s for s, w in zip(seqs, samples) if w]
            if sampling:
                self._sample(sampling, logits)
            self._stores_queued = self.runner.on_gpu and not sampling
            self.step_budget.observe(batch.num_decodes, batch.num_prefill_tokens, time.perf_counter() - now)
            for seq in seqs:
                request = seq.request
                if request.prefill_only and seq.num_computed == seq.num_tokens:
                    self.scheduler.remove(seq)
                    seq.status = Status.PREFILLED
                    seq.finish_reason = "prefilled"
                    request.kv_ready = kv_ready
                if seq.new_token_ids and not self.overlap_output or seq.is_finished and not self._text_due(seq):
                    touched[request.request_id] = request
        else:
            outputs = self._finish_text()
        sent = {o.request_id for o in outputs}
        return outputs + [self.output_of(r) for rid, r in touched.items() if rid not in sent]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        for seq, smp in zip(seqs, sample(logits, [s.sampling for s in seqs])):
            if seq.is_finished:
                continue  # a stop string in its last token's text ended it: drop this token
            if self.overlap_output:
                is_stop = append_token_id(seq, smp, self.eos_token_ids, self.max_model_len)
                self._text_pending.append((seq, smp.token_id, is_stop))
            else:
                append_token(seq, smp, self.eos_token_ids, self.max_model_len)
            if seq.index == 0:
                self._start_other_samples(seq.request)
            if seq.is_finished:
                self._finish(seq, seq.finish_reason)

    def _text_due(self, seq: Sequence) -> bool:
        return self.overlap_output and any(s is seq for s, _, _ in self._text_pending)

    def _finish_text(self) -> list[RequestOutput]:
        """The text half of the tokens the last step appended (overlapped mode), then the
        outputs of their requests."""
        if not self._text_pending:
            return []
        pending, self._text_pending = self._text_pending, []
        touched: dict[str, Request] = {}
        for seq, token, is_stop in pending:
            request = seq.request
            if self.requests.get(request.request_id) is not request:
                continue  # aborted since
            was_finished = seq.is_finished
            append_text(seq, token, is_stop)
            if seq.is_finished and not was_finished:
                self._finish(seq, seq.finish_reason)
            touched[request.request_id] = request
        return [self.output_of(r) for r in touched.values()]

    def _publish(self, seq: Sequence) -> None:
        """Full pages whose KV is computed become findable in the prefix cache."""
        full = min(seq.num_computed // self.page_size, len(seq.pages))
        if full <= seq.num_published:
            return
        extend_page_keys(seq.page_keys, seq.token_ids, self.page_size, full, seq.cache_salt)
        for p in range(seq.num_published, full):
            self.prefix_cache.publish(seq.pages[p], seq.page_keys[p])
        seq.num_published = full

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        self.scheduler.remove(seq)
        self.scheduler.free(seq)
        if seq.index == 0:
            self._start_other_samples(seq.request)

    def _start_other_samples(self, request: Request) -> None:
        if not request.other_samples_started:
            request.other_samples_started = True
            for other in request.seqs[1:]:
                self.scheduler.add(other)

    def output_of(self, request: Request) -> RequestOutput:
        """The delta of `request` since its last output (it then counts as sent)."""
        out = take_delta(request)
        if out.finished and not request.prefill_only:
            self.requests.pop(request.request_id, None)
        elif request.seqs[0].status is Status.PREFILLED:
            out.slots, out.kv_ready = self.slots_of(request.request_id), request.kv_ready
        return out

