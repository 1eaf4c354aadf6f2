"""The Llama-family transformer over the paged KV cache: weights (`weights`), rotary
tables (`rope`), the forward pass (`llama`) and the step-input builder (`runner`)."""

from .llama import LlamaModel
from .runner import ModelRunner

__all__ = ["LlamaModel", "ModelRunner"]
