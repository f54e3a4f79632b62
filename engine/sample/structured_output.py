"""Structured outputs: JSON Schema, JSON object, regex and choice constraints compiled to grammars with xgrammar.

xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for Large Language Models",
MLSys 2025; the grammar engine of vLLM and SGLang) compiles a constraint against the tokenizer's vocabulary once;
a `GrammarMatcher` per request then fills the request's row of a token bitmask each step (which tokens may come
next) and accepts the sampled token. engine.sample.logits_processors applies the bitmask of every constrained row of a
step
to the logits in one call (`xgrammar.apply_token_bitmask_inplace`, on CPU and CUDA).

Grammars are compiled once per distinct constraint (a million rows usually share a handful of schemas): this
manager keeps a dict from the constraint to its compiled grammar, or to the compile error, so a bad schema costs one
compile however many rows carry it. Compiles run on one background thread (`compile_async`; xgrammar releases the
GIL while it compiles): a schema that takes seconds to compile (a long `maxLength` string is a large automaton)
holds back only the rows that carry it, which the scheduler admits once their grammar is ready
(engine.sample.logits_processors.LogitsProcessors.ready); other rows keep stepping meanwhile. The xgrammar tokenizer
info
(about 0.5 s for a 49k vocabulary) is built on the first constrained request, so engines that never see one pay nothing.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.sampling_params import StructuredOutputsParams

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message a user can act on.
# JSON outputs have one layout, no free whitespace: json.dumps' default separators (", " between items, ": " after a
# key), no newlines or indentation, so `{"answer": 16}` is the only spelling of that object a row can produce.
JSON_SEPARATORS = (", ", ": ")
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class StructuredOutputManager:
    """Compiles constraints to xgrammar grammars (cached) and makes a matcher per request.

    Args:
        hf_tokenizer: the model's transformers tokenizer (engine.text.tokenizer.Tokenizer.hf_tokenizer).
        vocab_size: the model's vocabulary size (rows of the LM head; may exceed the tokenizer's: the extra ids are
            never allowed under a constraint).
        stop_token_ids: the ids that end a sequence (EOS and the model's other end ids): the grammar allows them
            exactly where the constrained text is complete, and accepting one terminates the matcher.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        # constraint -> Future of its CompiledGrammar, or of the ValueError naming why it does not compile
        self._grammars: dict[StructuredOutputsParams, Future] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile_async(self, spec: StructuredOutputsParams) -> Future:
        """The compile of `spec` on the background thread, started on first use and cached: a Future whose result is
        the CompiledGrammar or the ValueError (returned, not raised) naming the constraint's problem and the fix."""
        with self._lock:
            found = self._grammars.get(spec)
            if found is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-grammar")
                found = self._pool.submit(self._compile, spec)
                self._grammars[spec] = found
        return found

    def grammar(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec` (compiled on first use, then cached), waiting for its compile. Raises
        ValueError naming the constraint's problem (an unsupported JSON Schema feature, a regex that does not parse)
        and the fix."""
        return grammar_of(self.compile_async(spec))

    def _compile_now(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        try:
            if spec.json_schema is not None:
                return compiler.compile_json_schema(spec.json_schema, any_whitespace=False,
                                                    separators=JSON_SEPARATORS)
            if spec.json_object:  # an object, as OpenAI's json_object (xgrammar's builtin JSON also takes arrays)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                    separators=JSON_SEPARATORS)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            # A choice is a string literal of the grammar; JSON escapes are EBNF string escapes.
            ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices or ())
            return compiler.compile_grammar(ebnf)
        except RuntimeError as e:
            kind = ("json_schema" if spec.json_schema is not None else "regex" if spec.regex is not None
                    else "choices" if spec.choices is not None else "json_object")
            message = _CPP_PREFIX.sub("", str(e).strip()).strip()
            return ValueError(f"the {kind} constraint does not compile: {message}; fix the {kind}")

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        try:
            return self._compile_now(spec)
        except Exception as e:  # noqa: BLE001 - a compile must fail its rows, never the background thread's future
            return ValueError(f"the constraint does not compile ({type(e).__name__}: {e}); fix the constraint")

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh xgrammar GrammarMatcher for one request under `spec`. Raises ValueError as `grammar` does."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.grammar(spec))

    @property
    def num_compiled(self) -> int:
        """Distinct constraints compiled so far (failed ones included)."""
        return len(self._grammars)


def grammar_of(compiled: Future) -> Any:
    """The CompiledGrammar of a finished (or awaited) `compile_async` future; raises its ValueError."""
    found = compiled.result()
    if isinstance(found, ValueError):
        raise ValueError(str(found))
    return found
