"""`LLM`: the offline, batch-in batch-out face of the engine.

`LLM(model_dir).generate(prompts, SamplingParams(...))` adds every prompt, steps the
engine until all finish and returns one `RequestOutput` per prompt, in prompt order.
"""

from __future__ import annotations

from .config import EngineConfig, SamplingParams
from .engine import Engine
from .outputs import RequestOutput


class LLM:
    def __init__(self, model_dir: str, page_size: int = 16, **engine_config_kwargs):
        self.engine = Engine(EngineConfig(model_dir=str(model_dir), page_size=page_size, **engine_config_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, params in zip(prompts, sampling_params):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, token_ids, params)
            ids.append(request_id)
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < len(ids):
                if not self.engine.has_unfinished():
                    raise RuntimeError("engine went idle before every request finished")
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        finally:
            for request_id in ids:
                if request_id not in finals:
                    self.engine.abort(request_id)
        return [finals[r] for r in ids]

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks (they also die with this process)."""
        self.engine.close()
