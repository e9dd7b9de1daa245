"""What a request asks of sampling (`SamplingParams`, checked when built) and what it gets back
(`TokenLogprob`). Pure Python: the ingress and the replica validate and carry these without torch;
the draw itself is in `sampling_ops.py`."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import NamedTuple

MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request at most: each costs host work every step
LOGPROB_FLOOR = -9999.0  # what a -inf logprob is reported as: JSON has no infinity
# temperatures below this draw greedily: dividing fp32 logits by 1e-39 gives infinities, not a sharper
# distribution, and at 1e-5 the draw is the argmax anyway unless two logits tie within ~1e-4
GREEDY_BELOW = 1e-5


class InvalidRequest(ValueError):
    """A request that can never be served as asked (the serving layer's 400; `param` the field it names)."""

    param: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI's, over the tokens generated so far
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF's and vLLM's, over the prompt's and the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; k: the drawn token's logprob and the k most likely tokens'
    json_schema: str | None = None  # response_format: the canonical JSON schema the text must satisfy

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            # the sampler holds seeds in int64: a larger one would crash the engine step, not this request
            raise InvalidRequest(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty")
        self._check_penalties()
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise InvalidRequest(f"json_schema must be a schema as JSON text, got {type(self.json_schema).__name__}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidRequest(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0 or not -100.0 <= bias <= 100.0:
                raise InvalidRequest(
                    f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token!r}: {bias!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes this request's logits (then its token history is kept)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class TokenLogprob(NamedTuple):
    """One drawn token's logprob and the most likely tokens' (id, logprob), best first."""

    logprob: float
    top: list[tuple[int, float]]


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request for n choices: the request's own for choice 0 (so
    n = 1 draws what it always drew), else a hash of (seed, index) in [0, 2**63)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
