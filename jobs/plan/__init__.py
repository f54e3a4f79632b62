"""Before a job: the preflight checks (model, OUTPUT, store, device, --max-model-len), the model's memory fit on this
machine's device and the `--dry-run` forecast of its rows, tokens, device-hours and cost.

NOTE: imports nothing itself; import the modules (preflight and model_fit import no torch; forecast does).
"""
