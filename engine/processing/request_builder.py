"""Prompts into requests: the token ids a prompt runs as (chat template, raw text, messages or token ids, user text
never read as control tokens), its request or the parent request of its n samples (engine.processing.
parallel_sampling), and their logits-processor state; host work that touches no scheduler or cache state
(engine.llm_engine.LLMEngine.make_requests and the engine loop's submitters call it from any thread)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.request import Request
from engine.multimodal.inputs import MultiModalItem, is_image_prompt
from engine.multimodal.processor import ImageProcessor
from engine.outputs import RequestOutput
from engine.processing.parallel_sampling import ParentRequest, child_ids, child_params
from engine.sample.logits_processors import LogitsProcessors
from engine.sampling_params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.prompts import Prompt, prompt_problem
from engine.text.tokenizer import Tokenizer


class PromptTooLong(ValueError):
    """A prompt of more tokens than the engine's max_model_len leaves room for; `token_ids` is the prompt as it
    would have run, so its error output can report its real length."""

    def __init__(self, message: str, token_ids: list[int]) -> None:
        super().__init__(message)
        self.token_ids = token_ids


def lpt_key(request: Request) -> int:
    """Admission order of an offline batch: longest first by prompt + max_tokens (the LPT rule, Graham 1969)."""
    return -(request.num_prompt_tokens + request.sampling_params.max_tokens)


class RequestBuilder:
    """Makes the requests of an engine's prompts.

    Args:
        tokenizer: the engine's tokenizer, or None (random weights: prompts must be token ids).
        vocab_size: the model's vocabulary (token ids must be below it).
        max_model_len: most tokens per request (a prompt needs at least one fewer).
        logits_processors: the engine's logits-processor state, where each request that needs one is registered.
        image_processor: a vision-language model's processor (engine.multimodal.processor), which turns the image
            prompts (engine.multimodal's forms) into token ids and images; None for a text-only model.
        max_image_tokens: the most placeholders one image may take, for a model that prefills each image in one
            step (ModelBase.bidirectional_images: the step's max_num_batched_tokens); None: no limit.
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 logits_processors: LogitsProcessors, image_processor: ImageProcessor | None = None, *,
                 max_image_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.logits_processors = logits_processors
        self.image_processor = image_processor
        self.max_image_tokens = max_image_tokens

    def prompt_inputs(self, prompt: Prompt, use_chat_template: bool = True, allow_special_tokens: bool = False
                      ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """(token ids, images) a prompt runs as: an image prompt through the model's processor (its placeholders
        expanded, engine.multimodal.processor.ImageProcessor.process), any other as `prompt_token_ids` with no
        images. Raises ValueError as those do, for an image prompt to a text-only model (refuse_images) or without
        a tokenizer, or for an image of more placeholders than max_image_tokens."""
        if not is_image_prompt(prompt):
            return self.prompt_token_ids(prompt, use_chat_template, allow_special_tokens), ()
        self.refuse_images([prompt])
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: image prompts need the model's tokenizer")
        ids, images = self.image_processor.process(prompt, self.tokenizer, use_chat_template, allow_special_tokens)
        cap = self.max_image_tokens
        longest = max((item.length for item in images), default=0)
        if cap is not None and longest > cap:
            raise ValueError(f"an image takes {longest} placeholder tokens, more than a step's "
                             f"max_num_batched_tokens {cap}; this model prefills each image in one step (its "
                             f"placeholders attend to each other): set max_num_batched_tokens >= {longest}")
        return ids, images

    def refuse_images(self, prompts: Sequence[object]) -> None:
        """Raise ValueError (one line) when the model is text-only and a prompt of `prompts` carries images (an
        image prompt form: engine.multimodal)."""
        if self.image_processor is None:
            for i, prompt in enumerate(prompts):
                if is_image_prompt(prompt):
                    raise ValueError(f"prompt {i} carries images but this model is text-only (it takes no images); "
                                     "use a vision-language model (e.g. a LLaVA folder) or send text")

    def prompt_token_ids(self, prompt: Prompt, use_chat_template: bool = True,
                         allow_special_tokens: bool = False) -> list[int]:
        """The token ids a prompt runs as (see `generate` for the flags): text through the chat template or raw,
        messages through the chat template, token ids as they are. User text is encoded as text (engine.text.tokenizer):
        a control token's spelling in it is never the control token unless `allow_special_tokens`.
        Raises ValueError for a prompt that cannot run: what engine.text.prompts.prompt_problem finds (the validator the
        pipeline runs too), token ids outside the vocabulary, or text without a tokenizer."""
        problem = prompt_problem(prompt)
        if problem is not None:
            raise ValueError(problem)
        is_token_ids = all(isinstance(t, int) for t in prompt)  # a non-empty list: prompt_problem passed it
        if self.tokenizer is None and not is_token_ids:
            raise ValueError("this engine has no tokenizer (random-weights preset): give prompts as token ids")
        if isinstance(prompt, str):
            if use_chat_template:
                return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                          allow_special_tokens=allow_special_tokens)
            return self.tokenizer.encode(prompt, allow_special_tokens=allow_special_tokens)
        if is_token_ids:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
            return list(prompt)
        return self.tokenizer.apply_chat_template(prompt, allow_special_tokens=allow_special_tokens)

    def _make_requests(self, request_id: str, prompt: Prompt, params: SamplingParams, use_chat_template: bool,
                       allow_special_tokens: bool, taken: set[str]) -> Request | ParentRequest:
        """The request of one prompt, or (params.n > 1) the parent request of its n samples: children with n=1,
        seed + j when seeded, and ids from parallel_sampling.child_ids, none in `taken` (the batch's other ids).
        Their prompts are the same token ids, so the prefix cache computes the prompt's full blocks once (siblings
        queued behind the first one's prefill take them from the cache). Raises ValueError for a prompt that cannot
        run or a constraint that does not compile."""
        token_ids, images = self.prompt_inputs(prompt, use_chat_template, allow_special_tokens)
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLong(f"the prompt has {len(token_ids)} tokens; at most {self.max_model_len - 1} fit "
                                f"(max_model_len {self.max_model_len} includes at least one output token): shorten "
                                "it", token_ids)
        mrope = None if not images else self.image_processor.mrope_positions(len(token_ids), images)
        if params.n == 1:
            children = [(request_id, params)]
        else:
            children = list(zip(child_ids(request_id, params.n, taken),
                                (child_params(params, j) for j in range(params.n)), strict=True))
        requests = []
        try:
            for rid, sp in children:
                detokenizer = IncrementalDetokenizer(self.tokenizer, sp.stop) if self.tokenizer is not None else None
                req = Request(rid, token_ids, sp, detokenizer, images, mrope)
                self.logits_processors.add(req)
                requests.append(req)
        except ValueError:
            for req in requests:
                self.logits_processors.pop(req.request_id)
            raise
        return requests[0] if params.n == 1 else ParentRequest(request_id, requests)

    def make_requests(self, prompts: Sequence[Prompt],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                      request_ids: Sequence[str] | None = None, use_chat_template: bool = True,
                      allow_special_tokens: bool = False) -> list[Request | ParentRequest | RequestOutput]:
        """Tokenize and check each prompt (see `generate` for the arguments): per prompt, in order, its request
        ready to queue, the parent request of its n > 1 samples (queue its children: parallel_sampling.
        engine_requests), or an error RequestOutput (finish_reason "error") for a prompt that cannot run; each under
        the prompt's id. Host work: it touches no scheduler or cache state, so any thread may call it (it
        registers each request's logits-processor state, keyed by request id). An over-long prompt's error output
        has its prompt_token_ids (its real length); other error outputs have none. Raises ValueError when the lengths
        of prompts, params and ids differ, or ids repeat, or a prompt carries images for a text-only model
        (refuse_images)."""
        self.refuse_images(prompts)
        n = len(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        ids = [str(i) for i in range(n)] if request_ids is None else [str(r) for r in request_ids]
        if len(params) != n or len(ids) != n:
            raise ValueError(f"got {n} prompts, {len(params)} sampling params and {len(ids)} request ids; "
                             "give one per prompt (or a single SamplingParams for all)")
        if len(set(ids)) != n:
            raise ValueError("request_ids must be unique")
        prepared: list[Request | ParentRequest | RequestOutput] = []
        taken = set(ids)  # the engine ids of the batch: the prompts' own, and their samples' as they are made
        for rid, prompt, sp in zip(ids, prompts, params, strict=True):
            try:
                prepared.append(self._make_requests(rid, prompt, sp, use_chat_template, allow_special_tokens, taken))
            except ValueError as e:  # an over-long prompt's error output keeps its tokens: its real length
                tokens = e.token_ids if isinstance(e, PromptTooLong) else []
                prepared.append(RequestOutput(rid, tokens, [], "", "error", error=str(e)))
        return prepared
