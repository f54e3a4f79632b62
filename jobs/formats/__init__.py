"""A job's input and output in other formats: OpenAI batch files in (openai_batch) and out (openai_batch_export), and
the run's HTML report (report).

NOTE: imports nothing itself; import the modules.
"""
