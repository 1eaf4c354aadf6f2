"""`engine.warm_up`: the throw-away request a worker runs before it serves leaves the engine
as it found it: no request held, every page free, nothing in the prefix cache (a router
must not see the warm-up's prompt as cached)."""

from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.warm_up import REQUEST_ID, warm_up


@pytest.mark.parametrize("page_size,num_pages", [(4, 64), (8, 2), (1, 3)])
def test_warm_up_leaves_no_request_page_or_cached_prefix(make_engine, page_size, num_pages):
    engine = make_engine(page_size=page_size, num_pages=num_pages)
    warm_up(engine)
    assert not engine.has_unfinished() and REQUEST_ID not in engine.requests
    assert engine.num_free_pages() == engine.num_total_pages()
    # The warm-up's prompt again: computed afresh, not found in the prefix cache.
    prompt = [i % engine.vocab_size for i in range(page_size + 1)][:max(1, (num_pages - 1) * page_size)]
    engine.add_request("again", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.num_cached_tokens for o in outs if o.finished] == [0]


def test_warm_up_leaves_the_step_budget_measures_of_warm_steps_only(make_engine):
    engine = make_engine()
    warm_up(engine)
    budget = engine.step_budget
    assert budget.decode_step_s(1) > 0 and 0 < budget._prefill[1] <= 2 * engine.page_size
