"""Request and output processing around the engine's step: prompts into requests (request_builder), a prompt's
n > 1 samples as one parent request (parallel_sampling), finished requests into RequestOutputs (output_builder) and
the offline batch of LLMEngine.generate (offline_batch). Host work only: no scheduler, cache or model state."""
