"""When a request stops: the finish_reason after each token it samples (plain Python, no torch). The scheduler asks
(engine.core.scheduler.Scheduler.update_from_output); the reasons are the OpenAI API's ("stop", "length")."""

from __future__ import annotations

from collections.abc import Collection

from engine.core.request import Request


def check_stop(request: Request, eos_token_id: int | None, max_model_len: int,
               eos_token_ids: Collection[int] = ()) -> str | None:
    """finish_reason after the token just appended to `request`, or None to go on.

    "stop": EOS or any of the model's other end-of-sequence ids `eos_token_ids` (Llama 3's <|eot_id|>; unless
    ignore_eos), one of stop_token_ids, or a stop string completed in the text (requests with
    stop strings only: their incremental detokenizer searches the new characters); "length": max_tokens output
    tokens, or max_model_len tokens in all.
    """
    sp = request.sampling_params
    output = request.output_token_ids
    token = output[-1]
    if not sp.ignore_eos and (token == eos_token_id or token in eos_token_ids):
        return "stop"
    if sp.stop_token_ids and token in sp.stop_token_ids:
        return "stop"
    # Only requests with stop strings need their text every step: the new token decoded, a few characters
    # searched. The others are decoded once, when their output is built.
    if sp.stop and request.detokenizer is not None and request.detokenizer.update(output) is not None:
        return "stop"
    if len(output) >= sp.max_tokens or len(request.all_token_ids) >= max_model_len:
        return "length"
    return None
